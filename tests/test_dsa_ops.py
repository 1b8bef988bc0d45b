"""DeepSeek sparse attention's ops (ops/sparse_attention.py) against naive formulas: the indexer's
scores and top-k over a paged, NaN-filled indexer key cache, in prefill chunks and decode, with
ties broken as torch.topk breaks them on the whole row; MLA over the selected tokens equal to dense
MLA masked to them; an int8 (C8) indexer cache; and the attention's work fixed by k."""

from __future__ import annotations

import pytest
import torch

from executor.types_.kv_cache_spec import dsa_spec
from executor.types_.quant_scheme import TENSOR, KVCacheScheme
from ops import quant_math, sparse_attention
from ops.attention.metadata import ScheduledSequence, TorchMetadataBuilder, build_step_layout
from ops.backend import make_backend
from ops.sparse_attention import NOT_SELECTED, indexer_topk, sparse_mla_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 80
HEADS, INDEX_DIM, TOPK = 3, 8, 5
MLA_HEADS, NOPE, ROPE, RANK, V_DIM = 2, 6, 4, 10, 7


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def metadata(query_lens: list[int], kv_lens: list[int]):
    """A step of requests with `query_lens` new tokens and `kv_lens` tokens after it, over shuffled
    blocks -> (metadata, block ids per request, each request's slots for positions 0 .. kv_len - 1)."""
    order = torch.randperm(NUM_BLOCKS - 1).add(1).tolist()
    blocks, sequences = [], []
    for query_len, kv_len in zip(query_lens, kv_lens, strict=True):
        count = -(-kv_len // BLOCK_SIZE)
        ids, order = order[:count], order[count:]
        blocks.append(ids)
        sequences.append(ScheduledSequence([0] * query_len, kv_len - query_len, [ids]))
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=40)
    slots = [
        [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
        for ids, n in zip(blocks, kv_lens, strict=True)
    ]
    return TorchMetadataBuilder(torch.device("cpu")).build(layout), slots


def filled_cache(slots: list[list[int]], width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A NaN cache [NUM_BLOCKS, BLOCK_SIZE, width] with random rows at `slots` -> (cache, rows per request)."""
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, width), float("nan"))
    rows = []
    for request_slots in slots:
        values = torch.randn(len(request_slots), width)
        cache.view(-1, width)[torch.tensor(request_slots)] = values
        rows.append(values)
    return cache, rows


def naive_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> list[torch.Tensor]:
    """The indexer formula query by query: sum_h w_h relu(q_h . k scale) for each token up to the query."""
    q_len, length = query.shape[0], keys.shape[0]
    return [
        torch.tensor(
            [
                sum(weights[row, h] * torch.relu(query[row, h] @ keys[t] * scale) for h in range(HEADS))
                for t in range(length - q_len + row + 1)
            ]
        )
        for row in range(q_len)
    ]


def assert_best_visible(picks: list[list[int]], scores: list[torch.Tensor]) -> None:
    """Each row picks min(TOPK, visible) distinct visible tokens whose scores are the best ones (ties
    may pick either token: the scores, not the indices, are compared), the rest NOT_SELECTED."""
    for row_picks, row_scores in zip(picks, scores, strict=True):
        chosen = [p for p in row_picks if p != NOT_SELECTED]
        count = min(TOPK, len(row_scores))
        assert len(set(chosen)) == len(chosen) == count and max(chosen) < len(row_scores)
        torch.testing.assert_close(row_scores[chosen].sort().values, row_scores.topk(count).values.sort().values)


@pytest.mark.parametrize(("query_lens", "kv_lens"), [([4, 9, 1], [4, 13, 3]), ([1, 1, 1], [2, 9, 17])])
def test_indexer_topk_selects_each_querys_best_visible_tokens(query_lens, kv_lens):
    forward_metadata, slots = metadata(query_lens, kv_lens)
    cache, keys = filled_cache(slots, INDEX_DIM)
    query, weights = torch.randn(sum(query_lens), HEADS, INDEX_DIM), torch.randn(sum(query_lens), HEADS)
    table = forward_metadata.groups[0].block_table
    picks = indexer_topk(query, weights, cache, table, forward_metadata, 0.3, TOPK)
    assert picks.shape == (sum(query_lens), TOPK)
    start = 0
    for request_keys, query_len in zip(keys, query_lens, strict=True):
        rows = slice(start, start + query_len)
        assert_best_visible(picks[rows].tolist(), naive_scores(query[rows], weights[rows], request_keys, 0.3))
        start += query_len


def test_tied_indexer_scores_break_as_torch_topk_over_the_whole_masked_row():
    """All scores 0 (a zero query): the picks are torch.topk's over the request's row of kv_len
    scores with the tokens after each query at -inf, transformers' row, not any smaller one."""
    forward_metadata, slots = metadata([6], [30])
    cache, _ = filled_cache(slots, INDEX_DIM)
    query, weights = torch.zeros(6, HEADS, INDEX_DIM), torch.randn(6, HEADS)
    picks = indexer_topk(query, weights, cache, forward_metadata.groups[0].block_table, forward_metadata, 1.0, TOPK)
    causal = torch.arange(30)[None, :] <= torch.arange(24, 30)[:, None]
    row = torch.zeros(6, 30).masked_fill(~causal, float("-inf"))
    assert picks.tolist() == row.topk(TOPK, dim=-1).indices.tolist()


def test_an_int8_indexer_cache_selects_by_its_dequantized_keys():
    forward_metadata, slots = metadata([5], [11])
    cache, (keys,) = filled_cache(slots, INDEX_DIM)
    values, scales = quant_math.quantize_kv_per_token_head(keys.unsqueeze(1))
    int8_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, INDEX_DIM, dtype=torch.int8)
    scale_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1)
    slot_ids = torch.tensor(slots[0])
    int8_cache.view(-1, INDEX_DIM)[slot_ids] = values.squeeze(1)
    scale_cache.view(-1)[slot_ids] = scales.squeeze(1)
    query, weights = torch.randn(5, HEADS, INDEX_DIM), torch.randn(5, HEADS)
    table = forward_metadata.groups[0].block_table
    picks = indexer_topk(query, weights, int8_cache, table, forward_metadata, 0.3, TOPK, scale_cache)
    dequantized = quant_math.dequantize_kv(values, torch.float32, token_scale=scales).squeeze(1)
    assert_best_visible(picks.tolist(), naive_scores(query, weights, dequantized, 0.3))


def test_a_dynamic_c8_scheme_stores_the_indexer_key_in_int8_with_a_scale_per_token():
    dynamic = dsa_spec(RANK, ROPE, INDEX_DIM, torch.bfloat16, KVCacheScheme())
    assert [(t.name, t.shape, t.dtype) for t in dynamic.tensors] == [
        ("latent", (RANK + ROPE,), torch.int8),
        ("latent_scale", (), torch.float32),
        ("index_key", (INDEX_DIM,), torch.int8),
        ("index_key_scale", (), torch.float32),
    ]
    static = dsa_spec(RANK, ROPE, INDEX_DIM, torch.bfloat16, KVCacheScheme(strategy=TENSOR))
    assert [(t.name, t.dtype) for t in static.tensors] == [("latent", torch.int8), ("index_key", torch.bfloat16)]
    assert [t.name for t in dsa_spec(RANK, ROPE, None, torch.bfloat16).tensors] == ["latent"]  # a shared layer


def dense_mla(q_nope, q_pe, latents, kv_b_weight, scale, allowed):
    """MLA decompressed (per-head k = [W_UK latent, k_pe], v = W_UV latent), softmax over `allowed` keys."""
    latent, k_pe = latents.split([RANK, ROPE], dim=-1)
    k_nope, value = (
        torch.nn.functional.linear(latent, kv_b_weight).view(-1, MLA_HEADS, NOPE + V_DIM).split([NOPE, V_DIM], -1)
    )
    key = torch.cat((k_nope, k_pe[:, None].expand(-1, MLA_HEADS, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1)
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khv->qhv", probs, value)


@pytest.mark.parametrize(("query_lens", "kv_lens"), [([4, 9, 1], [4, 13, 3]), ([1, 1, 1], [2, 9, 17])])
def test_sparse_mla_equals_dense_mla_masked_to_the_selected_tokens(query_lens, kv_lens):
    forward_metadata, slots = metadata(query_lens, kv_lens)
    cache, latents = filled_cache(slots, RANK + ROPE)
    rows = sum(query_lens)
    q_nope, q_pe = torch.randn(rows, MLA_HEADS, NOPE), torch.randn(rows, MLA_HEADS, ROPE)
    kv_b_weight = torch.randn(MLA_HEADS * (NOPE + V_DIM), RANK)
    selection = torch.full((rows, TOPK), NOT_SELECTED)
    start = 0
    for query_len, kv_len in zip(query_lens, kv_lens, strict=True):
        for row in range(query_len):
            visible = kv_len - query_len + row + 1
            picks = torch.randperm(visible)[:TOPK]
            selection[start + row, : len(picks)] = picks
        start += query_len
    table = forward_metadata.groups[0].block_table
    out = sparse_mla_attention(q_nope, q_pe, cache, kv_b_weight, table, selection, forward_metadata, 0.2)
    start = 0
    for request_latents, query_len, kv_len in zip(latents, query_lens, kv_lens, strict=True):
        allowed = torch.zeros(query_len, kv_len, dtype=torch.bool)
        for row in range(query_len):
            allowed[row, [p for p in selection[start + row].tolist() if p >= 0]] = True
        rows_ = slice(start, start + query_len)
        expected = dense_mla(q_nope[rows_], q_pe[rows_], request_latents, kv_b_weight, 0.2, allowed)
        torch.testing.assert_close(out[rows_], expected, atol=1e-5, rtol=1e-5)
        start += query_len


def test_sparse_mla_gathers_k_latents_per_query_whatever_the_context(monkeypatch):
    """The attention reads exactly TOPK latent rows per query, at 13 tokens of context as at 130."""
    gathered = []
    original = sparse_attention.selected_slots

    def counting(*args):
        slots = original(*args)
        gathered.append(slots.numel())
        return slots

    monkeypatch.setattr(sparse_attention, "selected_slots", counting)
    for kv_len in (13, 130):
        forward_metadata, slots = metadata([1, 1], [kv_len, kv_len])
        cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, RANK + ROPE)
        selection = torch.stack([torch.randperm(kv_len)[:TOPK] for _ in range(2)])
        sparse_mla_attention(
            torch.randn(2, MLA_HEADS, NOPE),
            torch.randn(2, MLA_HEADS, ROPE),
            cache,
            torch.randn(MLA_HEADS * (NOPE + V_DIM), RANK),
            forward_metadata.groups[0].block_table,
            selection,
            forward_metadata,
            0.2,
        )
    assert gathered == [2 * TOPK, 2 * TOPK]


def test_the_cpu_record_runs_the_dsa_references():
    cpu = make_backend("cpu", "eager", torch.float32)
    assert cpu.indexer_topk is indexer_topk and cpu.sparse_mla_attention is sparse_mla_attention
