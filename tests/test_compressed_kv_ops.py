"""DeepSeek-V4's compressed-KV ops (ops/compressed_kv.py) and compressor (module/compressor.py) against
naive per-token formulas, over scattered blocks of NaN-filled caches, in packed and decode steps;
and the cache spec of a compressed tensor (one entry per ratio tokens)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from executor.types_.kv_cache_spec import KVCacheSpec, KVTensorSpec
from module.compressor import Compressor
from module.interleaved_rope import InterleavedRope, apply_interleaved_rope
from ops import torch_ref
from ops.attention.metadata import ScheduledSequence, TorchMetadataBuilder, build_model_inputs, build_step_layout
from ops.compressed_kv import compressed_indexer_topk, compressed_kv_attention, token_rows, write_cache_rows
from tests.backends import reference_backend
from tests.factories import deepseek_v4_config

BLOCK_SIZE, NUM_BLOCKS, WIDTH = 8, 24, 8  # 8 blocks per request at most


def blocks_for(lengths: list[int], seed: int = 0) -> list[list[int]]:
    free = random.Random(seed).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)
    rows = []
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        rows.append(free[:count])
        free = free[count:]
    return rows


def metadata(sequences: list[ScheduledSequence]):
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=WIDTH)
    inputs = build_model_inputs(layout, TorchMetadataBuilder(torch.device("cpu")))
    return inputs, inputs.forward_metadata


def steps(seq_lens: list[int], query_lens: list[int]) -> tuple:
    """One packed step: request i has seq_lens[i] tokens after it, its last query_lens[i] fed now."""
    rows = blocks_for(seq_lens)
    sequences = [
        ScheduledSequence([0] * q, total - q, [blocks])
        for total, q, blocks in zip(seq_lens, query_lens, rows, strict=True)
    ]
    return metadata(sequences)


def filled_cache(per_block: int, dim: int, seed: int) -> torch.Tensor:
    """Random rows, the null block NaN: a read of it would show."""
    cache = torch.randn(NUM_BLOCKS, per_block, dim, generator=torch.Generator().manual_seed(seed))
    cache[0] = float("nan")
    return cache


def entry_of(cache: torch.Tensor, block_table: torch.Tensor, row: int, entry: int, ratio: int) -> torch.Tensor:
    token = entry * ratio
    return cache[block_table[row, token // BLOCK_SIZE], (token % BLOCK_SIZE) // ratio]


def naive_attention(query, kv_cache, entry_cache, block_table, rows, positions, sinks, scale, window, ratio, selected):
    """Per token: softmax over [its window's keys, its entries, the sink], the keys as values."""
    outputs = []
    for t in range(query.shape[0]):
        row, position = int(rows[t]), int(positions[t])
        window_positions = range(max(0, position - window + 1), position + 1)
        keys = [kv_cache[block_table[row, p // BLOCK_SIZE], p % BLOCK_SIZE] for p in window_positions]
        if entry_cache is not None:
            closed = range((position + 1) // ratio)
            entries = closed if selected is None else [int(e) for e in selected[t] if e >= 0]
            keys += [entry_of(entry_cache, block_table, row, e, ratio) for e in entries]
        keys = torch.stack(keys)
        logits = query[t] @ keys.T * scale  # [H, K]
        weights = torch.exp(logits) / (torch.exp(logits).sum(-1, keepdim=True) + torch.exp(sinks)[:, None])
        outputs.append(weights @ keys)
    return torch.stack(outputs)


@pytest.mark.parametrize("kind", ["sliding", "heavily_compressed", "compressed_sparse"])
@pytest.mark.parametrize(("seq_lens", "query_lens"), [([23, 9, 40], [23, 4, 11]), ([23, 9, 40], [1, 1, 1])])
def test_compressed_kv_attention_is_the_per_token_formula(kind, seq_lens, query_lens):
    inputs, forward_metadata = steps(seq_lens, query_lens)
    ratio, heads, dim, window = 4, 3, 16, 6
    generator = torch.Generator().manual_seed(1)
    tokens = len(inputs.positions)
    query, sinks = torch.randn(tokens, heads, dim, generator=generator), torch.randn(heads, generator=generator)
    kv_cache = filled_cache(BLOCK_SIZE, dim, 2)
    entry_cache = None if kind == "sliding" else filled_cache(BLOCK_SIZE // ratio, dim, 3)
    rows = token_rows(forward_metadata, tokens, torch.device("cpu"))
    selected = None
    if kind == "compressed_sparse":  # up to 3 closed entries per token, -1 past them
        closed = (inputs.positions + 1) // ratio
        picks = torch.stack([torch.randperm(max(int(c), 3), generator=generator)[:3] for c in closed])
        selected = torch.where(picks < closed[:, None], picks, torch.full_like(picks, -1))
    table = forward_metadata.groups[0].block_table
    args = (query, kv_cache, entry_cache, table)
    ours = compressed_kv_attention(*args, forward_metadata, inputs.positions, sinks, 0.25, window, ratio, selected)
    expected = naive_attention(*args, rows, inputs.positions, sinks, 0.25, window, ratio, selected)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("seq_lens", "query_lens"), [([23, 9, 40], [23, 4, 11]), ([23, 9, 40], [1, 1, 1])])
def test_compressed_indexer_topk_keeps_the_best_scored_closed_entries(seq_lens, query_lens):
    inputs, forward_metadata = steps(seq_lens, query_lens)
    ratio, heads, dim, top_k = 4, 8, 8, 3  # eight heads: no entry's ReLUs all 0, so no exact ties
    generator = torch.Generator().manual_seed(4)
    tokens = len(inputs.positions)
    query = torch.randn(tokens, heads, dim, generator=generator)
    head_weights = torch.randn(tokens, heads, generator=generator)
    cache = filled_cache(BLOCK_SIZE // ratio, dim, 5)
    table = forward_metadata.groups[0].block_table
    ours = compressed_indexer_topk(
        query, head_weights, cache, table, forward_metadata, inputs.positions, ratio, top_k, 0.5
    )
    rows = token_rows(forward_metadata, tokens, torch.device("cpu"))
    for t in range(tokens):
        closed = (int(inputs.positions[t]) + 1) // ratio
        keys = {e: entry_of(cache, table, int(rows[t]), e, ratio) for e in range(closed)}
        scores = {
            e: sum(float(head_weights[t, h]) * max(float(query[t, h] @ key), 0.0) * 0.5 for h in range(heads))
            for e, key in keys.items()
        }
        best = sorted(scores, key=scores.get, reverse=True)[:top_k]
        assert sorted(int(e) for e in ours[t] if e >= 0) == sorted(best)
        assert (ours[t] >= 0).sum() == min(top_k, closed)


def test_clamped_silu_experts_are_the_per_token_formula():
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(5, 8, generator=generator) * 8  # past the limit 4 often
    weights, ids = torch.rand(5, 2, generator=generator), torch.randint(0, 3, (5, 2), generator=generator)
    gate_up, down = torch.randn(3, 12, 8, generator=generator), torch.randn(3, 8, 6, generator=generator)
    ours = torch_ref.moe_experts_clamped_gate_silu(hidden, weights, ids, gate_up, down, 4.0)
    expected = torch.zeros_like(hidden)
    for t in range(5):
        for k in range(2):
            gate, up = (gate_up[ids[t, k]] @ hidden[t]).chunk(2)
            expected[t] += weights[t, k] * (down[ids[t, k]] @ (F.silu(gate.clamp(max=4.0)) * up.clamp(-4.0, 4.0)))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)


def compressor_and_caches(overlap: bool, ratio: int) -> tuple[Compressor, dict[str, torch.Tensor], InterleavedRope]:
    config = deepseek_v4_config()
    torch.manual_seed(7)
    compressor = Compressor("compressor", 32, 16, ratio, overlap, 1e-6, backend=reference_backend())
    for param in compressor.parameters():
        param.data.normal_(0.0, 0.5)
    specs = compressor.spec_tensors(torch.float32)
    caches = {t.name: torch.full(t.cache_shape(NUM_BLOCKS, BLOCK_SIZE), float("nan")) for t in specs}
    return compressor, caches, InterleavedRope(config)


def run_compressor(compressor, caches, rope, hidden: torch.Tensor, chunks: list[int], blocks: list[int]) -> None:
    done = 0
    for size in chunks:
        inputs, forward_metadata = metadata([ScheduledSequence([0] * size, done, [blocks])])
        tables = forward_metadata.groups[0]
        rows = token_rows(forward_metadata, size, torch.device("cpu"))
        where = (tables.block_table, rows, inputs.positions, tables.slot_mapping, rope)
        compressor(hidden[done : done + size], caches, *where)
        done += size


def naive_entry(compressor: Compressor, hidden: torch.Tensor, entry: int, rope: InterleavedRope) -> torch.Tensor:
    """Entry `entry` from the formula: softmax over its window (and, overlapping, the previous window's
    Ca half) of gate + ape, the weighted sum of kv, normed, rotated at the window's first position."""
    ratio, dim = compressor.ratio, compressor.head_dim
    kv, gate = compressor.wkv(hidden), compressor.wgate(hidden) + compressor.ape.repeat(len(hidden) // ratio, 1)
    window = slice(entry * ratio, (entry + 1) * ratio)
    if compressor.overlap:
        values, gates = [kv[window, dim:]], [gate[window, dim:]]
        if entry:
            previous = slice((entry - 1) * ratio, entry * ratio)
            values, gates = [kv[previous, :dim], *values], [gate[previous, :dim], *gates]
        values, gates = torch.cat(values), torch.cat(gates)
    else:
        values, gates = kv[window], gate[window]
    pooled = (values * gates.softmax(dim=0)).sum(0, keepdim=True)
    cos, sin = rope(torch.tensor([entry * ratio]), "compress", pooled.dtype)
    return apply_interleaved_rope(compressor.norm(pooled), cos, sin)[0]


@pytest.mark.parametrize(("overlap", "ratio"), [(False, 8), (True, 4)])
def test_compressor_entries_are_the_window_formula_however_the_tokens_are_chunked(overlap, ratio):
    hidden = torch.randn(40, 32, generator=torch.Generator().manual_seed(8))
    blocks = blocks_for([40])[0]
    whole = compressor_and_caches(overlap, ratio)
    run_compressor(*whole, hidden, [40], blocks)
    chunked = compressor_and_caches(overlap, ratio)
    run_compressor(*chunked, hidden, [5, 3, 7, 2, 9, 6, 8], blocks)  # no bound on a window's
    compressor, caches, rope = whole
    table = torch.tensor([blocks + [0] * (WIDTH - len(blocks))])
    for entry in range(40 // ratio):
        expected = naive_entry(compressor, hidden, entry, rope)
        for _, cache, _ in (whole, chunked):
            ours = entry_of(cache["compressor_entries"], table, 0, entry, ratio)
            torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_a_compressed_tensor_holds_one_entry_per_ratio_tokens_of_a_block():
    entries = KVTensorSpec("entries", (16,), torch.float32, tokens_per_entry=4)
    spec = KVCacheSpec((KVTensorSpec("kv", (16,), torch.float32), entries))
    assert entries.cache_shape(10, 8) == (10, 2, 16)
    assert spec.bytes_per_block(8) == 8 * 64 + 2 * 64
    assert spec.bytes_per_token == 64 + 16


def test_write_cache_rows_puts_each_row_at_its_slot():
    cache = torch.zeros(3, 2, 4)
    write_cache_rows(torch.ones(2, 4) * torch.tensor([[1.0], [2.0]]), cache, torch.tensor([5, 2]))
    assert cache[2, 1].eq(1).all() and cache[1, 0].eq(2).all() and cache.sum() == 12
