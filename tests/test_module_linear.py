"""Tensor-parallel weight loading: each rank's shard, put back together, is the full weight."""

from __future__ import annotations

import pytest
import torch

from executor.types_.errors import WeightLoadError
from module.embedding import ParallelLMHead, VocabParallelEmbedding
from module.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from module.parallel_group import ParallelGroup

TP_SIZE = 2
HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 16, 4, 4, 2


def rank_of(rank: int) -> ParallelGroup:
    """Rank `rank` of a TP group of TP_SIZE, without a process group: weight loading needs none."""
    return ParallelGroup("test_tp", rank, TP_SIZE)


def load(layer: torch.nn.Module, name: str, full: torch.Tensor, shard_id: int | str | None = None) -> torch.Tensor:
    param = getattr(layer, name)
    param.weight_loader(param, full, shard_id)
    return param.data


def test_column_parallel_splits_weight_and_bias_by_output_rows():
    weight, bias = torch.randn(8, HIDDEN), torch.randn(8)
    ranks = [ColumnParallelLinear(HIDDEN, 8, bias=True, tp=rank_of(r)) for r in range(TP_SIZE)]
    torch.testing.assert_close(torch.cat([load(layer, "weight", weight) for layer in ranks]), weight)
    torch.testing.assert_close(torch.cat([load(layer, "bias", bias) for layer in ranks]), bias)


def test_row_parallel_splits_weight_by_input_columns_and_replicates_bias():
    weight, bias = torch.randn(HIDDEN, 8), torch.randn(HIDDEN)
    ranks = [RowParallelLinear(8, HIDDEN, bias=True, tp=rank_of(r)) for r in range(TP_SIZE)]
    torch.testing.assert_close(torch.cat([load(layer, "weight", weight) for layer in ranks], dim=1), weight)
    for layer in ranks:
        torch.testing.assert_close(load(layer, "bias", bias), bias)


def test_merged_column_parallel_holds_each_ranks_slice_of_every_shard():
    gate, up = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    ranks = [MergedColumnParallelLinear(HIDDEN, [6, 6], tp=rank_of(r)) for r in range(TP_SIZE)]
    for layer in ranks:
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
    gate_parts, up_parts = zip(*(layer.weight.data.split(3) for layer in ranks), strict=True)
    torch.testing.assert_close(torch.cat(gate_parts), gate)
    torch.testing.assert_close(torch.cat(up_parts), up)


def test_qkv_parallel_splits_heads_of_q_k_and_v():
    full = {"q": torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN)}
    full["k"], full["v"] = torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    ranks = [QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, tp=rank_of(r)) for r in range(TP_SIZE)]
    local_sizes = [NUM_HEADS * HEAD_DIM // TP_SIZE] + [NUM_KV_HEADS * HEAD_DIM // TP_SIZE] * 2
    parts = []
    for layer in ranks:
        assert (layer.num_heads, layer.num_kv_heads) == (NUM_HEADS // TP_SIZE, NUM_KV_HEADS // TP_SIZE)
        for shard_id, tensor in full.items():
            load(layer, "weight", tensor, shard_id)
        parts.append(layer.weight.data.split(local_sizes))
    for index, shard_id in enumerate("qkv"):
        torch.testing.assert_close(torch.cat([rank_parts[index] for rank_parts in parts]), full[shard_id])


@pytest.mark.parametrize("layer_cls", [VocabParallelEmbedding, ParallelLMHead])
def test_vocab_parallel_splits_vocab_rows(layer_cls):
    table = torch.randn(32, HIDDEN)
    ranks = [layer_cls(32, HIDDEN, tp=rank_of(r)) for r in range(TP_SIZE)]
    torch.testing.assert_close(torch.cat([load(layer, "weight", table) for layer in ranks]), table)


def test_wrong_full_shape_is_a_weight_load_error_naming_both_shapes():
    layer = ColumnParallelLinear(HIDDEN, 8, tp=rank_of(1))
    with pytest.raises(WeightLoadError, match=r"expected \(8, 16\), got \(8, 15\)"):
        load(layer, "weight", torch.randn(8, HIDDEN - 1))


def test_uneven_split_is_rejected():
    with pytest.raises(ValueError, match="tp_size=2"):
        ColumnParallelLinear(HIDDEN, 7, tp=rank_of(0))
