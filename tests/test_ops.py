"""The torch reference of every op against a naive formula, and the backend switch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import ops
from executor.core.engine.model_inputs import ScheduledSequence, build_model_inputs
from executor.platform import npu_runtime

BLOCK_SIZE = 4
NUM_BLOCKS = 32
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


@pytest.fixture(autouse=True)
def torch_backend():
    ops.set_backend("torch")
    torch.manual_seed(0)


def test_rms_norm_matches_formula():
    x, weight = torch.randn(5, 16), torch.randn(16)
    expected = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), expected)


def test_add_rms_norm_returns_norm_of_sum_and_the_sum():
    x, residual, weight = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    normed, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, ops.rms_norm(x + residual, weight, 1e-5))


def test_apply_rotary_matches_hf():
    query, key = torch.randn(6, NUM_HEADS, HEAD_DIM), torch.randn(6, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.randn(6, HEAD_DIM // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)
    rotated_q, rotated_k = ops.apply_rotary(query, key, cos, sin)
    torch.testing.assert_close(rotated_q, expected_q)
    torch.testing.assert_close(rotated_k, expected_k)


def test_silu_and_mul_gates_with_the_first_half():
    x = torch.randn(3, 10)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


def test_write_kv_cache_puts_each_token_at_its_slot():
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    blocks = [7, 2, 19]  # scattered, out of order
    slots = [blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(10)]
    key, value = torch.randn(10, NUM_KV_HEADS, HEAD_DIM), torch.randn(10, NUM_KV_HEADS, HEAD_DIM)
    ops.write_kv_cache(key, value, key_cache, value_cache, torch.tensor(slots))
    for pos in range(10):
        block, offset = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        torch.testing.assert_close(key_cache[block, offset], key[pos])
        torch.testing.assert_close(value_cache[block, offset], value[pos])
    assert key_cache.count_nonzero() == key.count_nonzero()  # nothing else touched


def naive_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """query [q, H, D], contiguous key/value [kv, Hkv, D]; query row j is token kv - q + j."""
    q_len, kv_len = query.shape[0], key.shape[0]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, key) / math.sqrt(query.shape[-1])
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


def run_paged(query_lens: list[int], kv_lens: list[int], *, is_prefill: bool) -> None:
    """Scatter each request's K/V over shuffled blocks, fill every other slot with NaN, and compare
    paged attention with naive attention on the contiguous K/V."""
    block_order = torch.randperm(NUM_BLOCKS).tolist()
    key_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    sequences, contiguous_kv = [], []
    for q_len, kv_len in zip(query_lens, kv_lens, strict=True):
        num_blocks = -(-kv_len // BLOCK_SIZE)
        blocks, block_order = block_order[:num_blocks], block_order[num_blocks:]
        sequences.append(ScheduledSequence(list(range(q_len)), kv_len - q_len, blocks))
        key, value = torch.randn(kv_len, NUM_KV_HEADS, HEAD_DIM), torch.randn(kv_len, NUM_KV_HEADS, HEAD_DIM)
        slots = torch.tensor([blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(kv_len)])
        ops.write_kv_cache(key, value, key_cache, value_cache, slots)
        contiguous_kv.append((key, value))
    metadata = build_model_inputs(
        sequences, is_prefill=is_prefill, block_size=BLOCK_SIZE, device=torch.device("cpu")
    ).forward_metadata
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)

    output = ops.paged_attention(query, key_cache, value_cache, metadata, HEAD_DIM**-0.5)

    assert output.shape == query.shape
    expected = torch.cat(
        [naive_attention(q, k, v) for q, (k, v) in zip(query.split(query_lens), contiguous_kv, strict=True)]
    )
    torch.testing.assert_close(output, expected)


def test_paged_attention_prefill_is_causal_per_request():
    run_paged([5, 1, 9, 4], [5, 1, 9, 4], is_prefill=True)


def test_paged_attention_prefill_with_cached_prefix_is_bottom_right_causal():
    run_paged([3, 6, 2], [10, 6, 7], is_prefill=True)


def test_paged_attention_decode_batches_requests_and_ignores_garbage_slots():
    run_paged([1, 1, 1, 1], [1, 6, 13, 4], is_prefill=False)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="'cuda'"):
        ops.set_backend("cuda")
    assert ops.current_backend() == "torch"


@pytest.mark.skipif(npu_runtime.npu_is_available(), reason="torch_npu works on this machine")
def test_npu_backend_without_torch_npu_raises_clear_error():
    with pytest.raises(npu_runtime.NpuUnavailableError, match="torch_npu"):
        ops.set_backend("npu")
    assert ops.current_backend() == "torch"


def test_every_op_has_an_npu_implementation():
    for name in ops.OPS:
        assert callable(getattr(ops.npu, name)), name
