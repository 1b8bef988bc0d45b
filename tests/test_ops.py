"""The torch reference of every op against a naive formula, and the backend switch."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from executor.platform import npu_runtime
from ops import cpu_kernels, torch_ref
from ops.attention import reference
from ops.attention.metadata import ScheduledSequence, TorchMetadataBuilder, build_step_layout
from ops.backend import Backend, make_backend
from tests.attention_layers import attend, write_kv
from tests.backends import cpu_backend, reference_backend

BLOCK_SIZE = 4
NUM_BLOCKS = 32
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None or shutil.which("ninja") is None, reason="the CPU kernels build with c++ and ninja"
)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def test_rms_norm_matches_formula():
    x, weight = torch.randn(5, 16), torch.randn(16)
    expected = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cpu_backend().rms_norm(x, weight, 1e-6), expected)


def test_add_rms_norm_returns_norm_of_sum_and_the_sum():
    x, residual, weight = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    normed, new_residual = cpu_backend().add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, cpu_backend().rms_norm(x + residual, weight, 1e-5))


def test_apply_rotary_matches_hf():
    query, key = torch.randn(6, NUM_HEADS, HEAD_DIM), torch.randn(6, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.randn(6, HEAD_DIM // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)
    rotated_q, rotated_k = cpu_backend().apply_rotary(query, key, cos, sin)
    torch.testing.assert_close(rotated_q, expected_q)
    torch.testing.assert_close(rotated_k, expected_k)


def test_silu_and_mul_gates_with_the_first_half():
    x = torch.randn(3, 10)
    torch.testing.assert_close(cpu_backend().silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


def test_gelu_tanh_and_mul_gates_with_the_first_half_by_the_tanh_formula():
    x = torch.randn(3, 10)
    gate, up = x[:, :5], x[:, 5:]
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    torch.testing.assert_close(cpu_backend().gelu_tanh_and_mul(x), tanh_gelu * up)


def test_write_kv_cache_puts_each_token_at_its_slot():
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    blocks = [7, 2, 19]  # scattered, out of order
    slots = [blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(10)]
    key, value = torch.randn(10, NUM_KV_HEADS, HEAD_DIM), torch.randn(10, NUM_KV_HEADS, HEAD_DIM)
    write_kv(cpu_backend().attention, key, value, key_cache, value_cache, torch.tensor(slots))
    for pos in range(10):
        block, offset = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        torch.testing.assert_close(key_cache[block, offset], key[pos])
        torch.testing.assert_close(value_cache[block, offset], value[pos])
    assert key_cache.count_nonzero() == key.count_nonzero()  # nothing else touched


def naive_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [q, H, D], contiguous key/value [kv, Hkv, D]; query row j is token kv - q + j, and sees
    the `sliding_window` tokens ending at itself when a window is given. Sinks [H] divide head h's
    weights by sum_k exp(score_k) + exp(sinks[h]) instead of the plain softmax denominator."""
    q_len, kv_len = query.shape[0], key.shape[0]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, key) / math.sqrt(query.shape[-1])
    key_positions, query_positions = torch.arange(kv_len)[None, :], torch.arange(kv_len - q_len, kv_len)[:, None]
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
    exp_scores = scores.exp()
    weights = exp_scores / (exp_scores.sum(-1, keepdim=True) + sinks.exp()[:, None, None])
    return torch.einsum("hqk,khd->qhd", weights, value)


def run_paged(
    query_lens: list[int],
    kv_lens: list[int],
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    poison_new_rows: bool = False,
    ops: Backend | None = None,
) -> None:
    """Scatter each request's K/V over shuffled blocks (never the null block 0), fill every other
    slot with NaN, and compare paged attention with naive attention on the contiguous K/V. With a
    window, blocks wholly before it are replaced by the null block, as the sliding-window manager
    does, and the null block holds NaN too. The op gets the step's own K/V (each request's last
    q_len positions) as the layer passes them; with `poison_new_rows` their cache slots then hold
    NaN, as if the op had to do without them. `ops`: the backend (the CPU's by default)."""
    ops = ops or cpu_backend()
    block_order = (torch.randperm(NUM_BLOCKS - 1) + 1).tolist()
    key_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    sequences, contiguous_kv, step_kv, new_slots = [], [], [], []
    for q_len, kv_len in zip(query_lens, kv_lens, strict=True):
        num_blocks = -(-kv_len // BLOCK_SIZE)
        blocks, block_order = block_order[:num_blocks], block_order[num_blocks:]
        sequences.append(ScheduledSequence(list(range(q_len)), kv_len - q_len, [blocks]))
        key, value = torch.randn(kv_len, NUM_KV_HEADS, HEAD_DIM), torch.randn(kv_len, NUM_KV_HEADS, HEAD_DIM)
        slots = torch.tensor([blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(kv_len)])
        write_kv(ops.attention, key, value, key_cache, value_cache, slots)
        contiguous_kv.append((key, value))
        step_kv.append((key[kv_len - q_len :], value[kv_len - q_len :]))
        new_slots.append(slots[kv_len - q_len :])
        if sliding_window is not None:
            first_needed_block = max(0, kv_len - q_len - sliding_window + 1) // BLOCK_SIZE
            blocks[:first_needed_block] = [0] * first_needed_block
    if poison_new_rows:
        key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[torch.cat(new_slots)] = float("nan")
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=NUM_BLOCKS)
    metadata = TorchMetadataBuilder(torch.device("cpu")).build(layout)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)
    step_key, step_value = (torch.cat(tensors) for tensors in zip(*step_kv, strict=True))
    block_table = metadata.groups[0].block_table

    args = (query, step_key, step_value, key_cache, value_cache, block_table, metadata, HEAD_DIM**-0.5)
    output = attend(ops.attention, *args, sliding_window, sinks)

    assert output.shape == query.shape
    expected = torch.cat(
        [
            naive_attention(q, k, v, sliding_window, sinks)
            for q, (k, v) in zip(query.split(query_lens), contiguous_kv, strict=True)
        ]
    )
    torch.testing.assert_close(output, expected)


@pytest.fixture(params=["kernel", "loop"])
def prefill_path(request) -> Backend:
    """Non-decode steps through the CPU prefill kernel (the CPU backend), or through the per-request
    torch loop (the reference)."""
    if request.param == "loop":
        return reference_backend()
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("the CPU kernels build with c++ and ninja")
    assert cpu_kernels.extension() is not None, "the kernel builds where a compiler is present"
    return cpu_backend()


def test_paged_attention_prefill_is_causal_per_request(prefill_path):
    run_paged([5, 1, 9, 4], [5, 1, 9, 4], ops=prefill_path)


def test_paged_attention_prefill_with_cached_prefix_is_bottom_right_causal(prefill_path):
    run_paged([3, 6, 2], [10, 6, 7], ops=prefill_path)


def test_paged_attention_decode_batches_requests_and_ignores_garbage_slots():
    run_paged([1, 1, 1, 1], [1, 6, 13, 4])


def test_paged_attention_verify_step_with_several_queries_per_request_is_causal(prefill_path):
    run_paged([3, 3, 3], [7, 3, 12], ops=prefill_path)


@pytest.mark.parametrize("query_lens, kv_lens", [([5, 9, 2], [5, 9, 10]), ([1, 1, 1], [2, 9, 14]), ([3, 2], [17, 22])])
def test_paged_attention_sliding_window_sees_only_the_window(query_lens, kv_lens, prefill_path):
    run_paged(query_lens, kv_lens, sliding_window=4, ops=prefill_path)


@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize("query_lens, kv_lens", [([5, 1, 9], [5, 1, 9]), ([3, 6, 2], [10, 6, 7]), ([3, 3], [7, 12])])
def test_paged_attention_takes_the_steps_key_value_from_the_layer_not_from_the_cache(
    query_lens, kv_lens, sliding_window, prefill_path
):
    """Prefill, cached prefix, verify: the new positions' cache rows are never read back."""
    run_paged(query_lens, kv_lens, sliding_window, poison_new_rows=True, ops=prefill_path)


# Prefill, cached prefix, decode, verify; with and without a window. Sinks of both signs and one
# large enough to take most of the weight.
SINK_CASES = [([5, 1, 9], [5, 1, 9]), ([3, 6], [10, 7]), ([1, 1, 1], [1, 6, 13]), ([3, 3], [7, 12])]


@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize("query_lens, kv_lens", SINK_CASES)
def test_paged_attention_with_sinks_adds_each_heads_sink_to_the_softmax_denominator(
    query_lens, kv_lens, sliding_window, prefill_path
):
    run_paged(query_lens, kv_lens, sliding_window, sinks=torch.tensor([-1.0, 0.0, 0.5, 3.0]), ops=prefill_path)


def test_a_sink_shrinks_a_heads_output_by_its_share_of_the_denominator():
    """One key per query: without a sink the output is its value; a sink of logit s (score 0 here)
    leaves 1 / (1 + e^s) of it."""
    value = torch.randn(1, NUM_KV_HEADS, HEAD_DIM)
    sinks = torch.tensor([0.0, 1.0, -2.0, 4.0])
    query, key = torch.zeros(1, NUM_HEADS, HEAD_DIM), torch.randn(1, NUM_KV_HEADS, HEAD_DIM)
    out = naive_attention(query, key, value, None, sinks)
    expected = value.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1) / (1 + sinks.exp())[None, :, None]
    torch.testing.assert_close(out, expected)


def naive_clamped_swiglu_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Token by token, choice by choice, as gpt-oss's model card writes the expert."""
    output = torch.zeros_like(hidden_states)
    for token, (weights, experts) in enumerate(zip(topk_weights, topk_ids, strict=True)):
        for weight, expert in zip(weights, experts.tolist(), strict=True):
            gate, up = (gate_up[expert] @ hidden_states[token] + gate_up_bias[expert]).chunk(2)
            gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
            glu = gate * torch.sigmoid(alpha * gate)
            output[token] += weight * (down[expert] @ ((up + 1) * glu) + down_bias[expert])
    return output


def test_moe_experts_clamped_swiglu_matches_the_per_token_formula_and_clamps():
    num_experts, hidden, intermediate, top_k = 5, 8, 6, 2
    hidden_states = 3 * torch.randn(7, hidden)  # large enough that some gates and ups pass the limit
    topk_ids = torch.tensor([[0, 1], [1, 0], [2, 4], [0, 2], [1, 2], [4, 1], [2, 0]])  # expert 3: no token
    topk_weights = torch.rand(7, top_k)
    gate_up, down = torch.randn(num_experts, 2 * intermediate, hidden), torch.randn(num_experts, hidden, intermediate)
    gate_up_bias, down_bias = torch.randn(num_experts, 2 * intermediate), torch.randn(num_experts, hidden)
    args = (hidden_states, topk_weights, topk_ids, gate_up, gate_up_bias, down, down_bias, 1.702, 7.0)
    pre_activation = torch.einsum("th,eih->tei", hidden_states, gate_up) + gate_up_bias
    assert (pre_activation[..., :intermediate] > 7.0).any() and (pre_activation[..., intermediate:].abs() > 7.0).any()
    torch.testing.assert_close(cpu_backend().moe_experts_clamped_swiglu(*args), naive_clamped_swiglu_experts(*args))


def naive_clamped_silu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Step-3.7-Flash's clamped SwiGLU, one element at a time: min(silu(g), limit) * clip(u, ±limit)."""
    flat = [
        min(g / (1 + math.exp(-g)), limit) * max(-limit, min(u, limit))
        for g, u in zip(gate.flatten().tolist(), up.flatten().tolist(), strict=True)
    ]
    return torch.tensor(flat, dtype=gate.dtype).view(gate.shape)


def test_clamped_silu_and_mul_matches_the_elementwise_formula_and_clamps():
    gate_up = 4 * torch.randn(5, 12)
    gate, up = gate_up.chunk(2, dim=-1)
    assert (F.silu(gate) > 2.0).any() and (up.abs() > 2.0).any()  # both clamps bite
    torch.testing.assert_close(cpu_backend().clamped_silu_and_mul(gate_up, 2.0), naive_clamped_silu(gate, up, 2.0))


def test_moe_experts_clamped_silu_matches_the_per_token_formula():
    num_experts, hidden, intermediate = 5, 8, 6
    hidden_states = 3 * torch.randn(7, hidden)
    topk_ids = torch.tensor([[0, 1], [1, 0], [2, 4], [0, 2], [1, 2], [4, 1], [2, 0]])  # expert 3: no token
    topk_weights = torch.rand(7, 2)
    gate_up, down = torch.randn(num_experts, 2 * intermediate, hidden), torch.randn(num_experts, hidden, intermediate)
    expected = torch.zeros_like(hidden_states)
    for token, (weights, experts) in enumerate(zip(topk_weights, topk_ids, strict=True)):
        for weight, expert in zip(weights, experts.tolist(), strict=True):
            gate, up = (gate_up[expert] @ hidden_states[token]).chunk(2)
            expected[token] += weight * (down[expert] @ naive_clamped_silu(gate, up, 3.0))
    result = cpu_backend().moe_experts_clamped_silu(hidden_states, topk_weights, topk_ids, gate_up, down, 3.0)
    torch.testing.assert_close(result, expected)


def test_moe_experts_gelu_tanh_matches_the_per_token_geglu_formula():
    num_experts, hidden, intermediate, top_k = 5, 8, 6, 2
    hidden_states = torch.randn(7, hidden)
    topk_ids = torch.tensor([[0, 1], [1, 0], [2, 4], [0, 2], [1, 2], [4, 1], [2, 0]])  # expert 3: no token
    topk_weights = torch.rand(7, top_k)
    gate_up, down = torch.randn(num_experts, 2 * intermediate, hidden), torch.randn(num_experts, hidden, intermediate)
    expected = torch.zeros_like(hidden_states)
    for token, (weights, experts) in enumerate(zip(topk_weights, topk_ids, strict=True)):
        for weight, expert in zip(weights, experts.tolist(), strict=True):
            gate, up = (gate_up[expert] @ hidden_states[token]).chunk(2)
            expected[token] += weight * (down[expert] @ (F.gelu(gate, approximate="tanh") * up))
    args = (hidden_states, topk_weights, topk_ids, gate_up, down)
    torch.testing.assert_close(cpu_backend().moe_experts_gelu_tanh(*args), expected)


def test_decode_attention_reads_only_up_to_the_longest_sequence_not_the_table_width():
    """The block table is as wide as max_model_len; the op must gather only the real K/V."""
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    query = torch.randn(2, NUM_HEADS, HEAD_DIM)
    narrow = torch.tensor([[1, 2, 0], [3, 0, 0]], dtype=torch.int32)
    wide = torch.cat([narrow, torch.zeros(2, 500, dtype=torch.int32)], dim=1)
    seq_lens = torch.tensor([6, 3])
    args = (query, key_cache, key_cache)
    with torch.profiler.profile(record_shapes=True) as prof:
        out_wide = reference.paged_decode_attention(*args, wide, seq_lens, 0.3, 0)
    out_narrow = reference.paged_decode_attention(*args, narrow, seq_lens, 0.3, 0)
    torch.testing.assert_close(out_wide, out_narrow)
    index_shapes = [e.input_shapes[2] for e in prof.events() if e.name == "aten::index_select"]
    assert index_shapes == [[2 * 6], [2 * 6]]  # K and V: 2 requests x the longest sequence (6), not x 503 blocks


# The bf16 decode kernel's two forms: AMX tiles where the CPU has them (test below), vectors.
DECODE_FORMS = pytest.mark.parametrize("allow_amx", [True, False], ids=["amx_where_it_fits", "vectors"])


@needs_compiler
def test_the_amx_decode_attention_serves_head_dims_64_and_128_in_blocks_of_whole_tiles_where_the_cpu_has_amx():
    """So that the kernel tests' AMX form runs the tiles on this CPU, not the vectors again."""
    fits = cpu_kernels.extension().amx_decode_attention_fits
    has_amx = {"amx_bf16", "avx512_bf16"} <= cpu_kernels.cpu_flags() and cpu_kernels.extension().amx_available()
    assert [fits(64, 16), fits(128, 128)] == [has_amx, has_amx]
    assert not any([fits(80, 16), fits(32, 16), fits(64, 8), fits(64, 24)])


@needs_compiler
@DECODE_FORMS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window, with_sinks", [(0, False), (5, False), (40, False), (0, True), (40, True)])
def test_cpu_decode_kernel_matches_the_gathered_reference(dtype, sliding_window, with_sinks, allow_amx):
    """The C++ kernel reads the cache in place; it must agree with the torch definition, whatever
    the table width, the window, the sinks and the storage dtype (fp32 accumulation in both)."""
    assert cpu_kernels.extension() is not None, "the kernel must build where a compiler is present"
    kernel = cpu_kernels.extension().paged_decode_attention
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    query = 3 * torch.randn(4, NUM_HEADS, HEAD_DIM, dtype=dtype)  # peaked softmaxes too
    # Request 3 spans several of the kernel's 32-key tiles, its last one partly.
    block_table = torch.tensor(
        [[4, 9, 2, 0] + [0] * 16, [7] + [0] * 19, [11, 3, 5, 8] + [0] * 16, list(range(12, 32))], dtype=torch.int32
    )
    seq_lens = torch.tensor([10, 1, 15, 78])
    sinks = torch.tensor([-1.0, 0.0, 0.5, 3.0], dtype=dtype) if with_sinks else None
    args = (query, key_cache, value_cache, block_table, seq_lens, 0.35, sliding_window, sinks)
    expected = reference.paged_decode_attention(*args)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(kernel(*args, None, None, None, allow_amx), expected, **tolerance)  # no C8 scales


@needs_compiler
@DECODE_FORMS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 24, 20])  # the unrolled dims, a multiple of 8 and not
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("sliding_window, with_sinks", [(0, False), (50, True)])
def test_cpu_decode_kernel_matches_the_reference_at_model_head_dims_and_block_sizes(
    dtype, head_dim, block_size, sliding_window, with_sinks, allow_amx
):
    """Requests of 1 to 300 tokens (tiles full, partial, a last one of a single key) in scattered
    blocks, 3 query heads per KV head as in SmolLM2."""
    num_kv_heads, seq_lens = 3, torch.tensor([1, 7, 33, 192, 300])
    blocks_per_request = -(-300 // block_size)
    num_blocks = len(seq_lens) * blocks_per_request + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = (torch.randperm(num_blocks - 1)[: len(seq_lens) * blocks_per_request] + 1).int()
    query = 3 * torch.randn(len(seq_lens), 3 * num_kv_heads, head_dim, dtype=dtype)
    sinks = torch.linspace(-2, 3, 3 * num_kv_heads, dtype=dtype) if with_sinks else None
    args = (query, key_cache, value_cache, block_table.view(len(seq_lens), -1), seq_lens, head_dim**-0.5)
    expected = reference.paged_decode_attention(*args, sliding_window, sinks)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    kernel = cpu_kernels.extension().paged_decode_attention
    torch.testing.assert_close(kernel(*args, sliding_window, sinks, None, None, None, allow_amx), expected, **tolerance)


@needs_compiler
@DECODE_FORMS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window, with_sinks", [(0, False), (40, False), (0, True), (40, True)])
# 8: the AVX2 tiles; 64 and 80 (a 64-float pass and a 16-float one) the AVX-512 tiles where the CPU has
# them, whose value sums take six query vectors a pass: 3 x 4 rows is two full passes, 3 x 3 one and a half.
# In bf16 the AMX tiles take 64 and 128 where the CPU has them, 16 vectors a pass: 5 x 4 is a full pass
# and a quarter.
@pytest.mark.parametrize("head_dim, rows_per_request, group", [(8, 4, 3), (64, 4, 3), (80, 3, 3), (128, 4, 5)])
def test_cpu_decode_kernel_reads_a_requests_rows_together_as_the_reference_reads_each(
    dtype, sliding_window, with_sinks, head_dim, rows_per_request, group, allow_amx
):
    """A verify step in a graph: 1 + k rows per request over its one block table, each up to its own
    length (the last rows of a request whose drafts ran short are padding of length 1); read once for
    all of a request's rows, each row must still get what the reference gives it alone."""
    num_kv_heads, block_size = 3, 16
    # the second over two of the kernel's 256-position chunks, the last a padding request
    lengths = [[7, 8, 9, 10], [270, 271, 272, 273], [96, 97, 1, 1], [1, 1, 1, 1]]
    lengths = [request[:rows_per_request] for request in lengths]
    blocks_per_request = 18
    num_blocks = len(lengths) * blocks_per_request + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = (torch.randperm(num_blocks - 1)[: len(lengths) * blocks_per_request] + 1).int().view(len(lengths), -1)
    tables[-1] = 0  # the padding request's all-null row
    block_table = tables.repeat_interleave(rows_per_request, dim=0)
    seq_lens = torch.tensor(lengths).flatten()
    query = 3 * torch.randn(len(seq_lens), group * num_kv_heads, head_dim, dtype=dtype)
    sinks = torch.linspace(-2, 3, group * num_kv_heads, dtype=dtype) if with_sinks else None
    args = (query, key_cache, value_cache, block_table, seq_lens, head_dim**-0.5, sliding_window, sinks)
    expected = reference.paged_decode_attention(*args)
    kernel = cpu_kernels.extension().paged_decode_attention
    together = kernel(*args, None, None, torch.tensor([rows_per_request]), allow_amx)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(together, expected, **tolerance)
    torch.testing.assert_close(together, kernel(*args, None, None, None, allow_amx), rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="rows_per_request must divide"):
        kernel(*args, None, None, torch.tensor([5]), allow_amx)  # 16 or 12 rows


@needs_compiler
@DECODE_FORMS
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_decode_kernel_reads_nothing_of_the_slots_past_a_requests_end(head_dim, allow_amx):
    """The AMX form loads whole 16-position tiles of keys and 32-position steps of values: slots past a
    request's length in its last block (here NaN, as a freed block may hold anything) must weigh nothing."""
    num_kv_heads, block_size, lengths = 3, 16, [5, 20, 37, 1]
    tables = torch.arange(1, 4 * len(lengths) + 1, dtype=torch.int32).view(len(lengths), -1)
    clean = torch.zeros(4 * len(lengths) + 1, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = clean.clone(), clean.clone()
    for cache in (key_cache, value_cache):
        cache.fill_(float("nan"))
        for table, length in zip(tables, lengths, strict=True):
            slots = table.repeat_interleave(block_size)[:length] * block_size + torch.arange(length) % block_size
            rows = torch.randn(length, num_kv_heads, head_dim, dtype=torch.bfloat16)
            cache.view(-1, num_kv_heads, head_dim)[slots] = rows
    query = 3 * torch.randn(len(lengths), 3 * num_kv_heads, head_dim, dtype=torch.bfloat16)
    args = (query, key_cache, value_cache, tables, torch.tensor(lengths), head_dim**-0.5, 0, None)
    expected = reference.paged_decode_attention(query, key_cache.nan_to_num(0), value_cache.nan_to_num(0), *args[3:])
    out = cpu_kernels.extension().paged_decode_attention(*args, None, None, None, allow_amx)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def reference_cache_write(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """What torch_ref's index_copy_ form leaves in a copy of `cache`."""
    expected = cache.clone()
    expected.view(-1, *rows.shape[1:]).index_copy_(0, slot_mapping, rows)
    return expected


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 1500])  # decode-sized on the calling thread, prefill-sized split
def test_cpu_kv_cache_write_matches_index_copy_for_views_of_a_fused_projection(dtype, num_tokens):
    key_cache = torch.randn(200, 16, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dtype)
    _, key, value = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    key, value = key.view(num_tokens, NUM_KV_HEADS, HEAD_DIM), value.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slot_mapping = torch.randperm(200 * 16)[:num_tokens]
    expected_key = reference_cache_write(key, key_cache, slot_mapping)
    expected_value = reference_cache_write(value, value_cache, slot_mapping)
    with torch.profiler.profile() as profile:
        write_kv(cpu_backend(dtype).attention, key, value, key_cache, value_cache, slot_mapping)
    assert "infer_recipes::write_kv_cache" in {event.name for event in profile.events()}, "the C++ write must run"
    assert torch.equal(key_cache, expected_key) and torch.equal(value_cache, expected_value)


@needs_compiler
def test_cpu_latent_cache_write_matches_index_copy():
    latent_cache = torch.randn(20, 16, 40)
    latent, slot_mapping = torch.randn(7, 40), torch.tensor([5, 300, 17, 0, 319, 64, 65])
    expected = reference_cache_write(latent, latent_cache, slot_mapping)
    cpu_backend().attention.write_latent_cache(latent, latent_cache, slot_mapping)
    assert torch.equal(latent_cache, expected)


@needs_compiler
@pytest.mark.parametrize("bad_slot", [-1, NUM_BLOCKS * BLOCK_SIZE])
def test_cpu_kv_cache_write_rejects_a_slot_outside_the_cache_and_writes_nothing(bad_slot):
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    key = value = torch.ones(2, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="slot_mapping must lie in"):
        write_kv(cpu_backend().attention, key, value, key_cache, value_cache, torch.tensor([3, bad_slot]))
    assert key_cache.count_nonzero() == 0 and value_cache.count_nonzero() == 0


@needs_compiler
@pytest.mark.parametrize("rows, width", [(1, 576), (5, 20), (37, 1536), (300, 1536)])  # the last split over threads
def test_fused_cpu_kernels_match_the_reference_formulas(rows, width):
    """The fp32 fused kernels (one pass per row) against the reference's torch ops, at widths that
    are and are not multiples of the vector length; SiLU's gate spans magnitudes that overflow exp."""
    assert cpu_kernels.extension() is not None, "the kernels must build here"
    x, residual, weight = torch.randn(rows, width), torch.randn(rows, width), torch.randn(width)
    gate_up = torch.randn(rows, 2 * width) * 30
    qkv = torch.randn(rows, 8 * 16)  # q: 4 heads, k and v: 2 each, as views of one fused projection
    query, key = qkv[:, : 4 * 16].view(rows, 4, 16), qkv[:, 4 * 16 : 6 * 16].view(rows, 2, 16)
    cos_sin = torch.randn(rows, 32)
    cos, sin = cos_sin.chunk(2, dim=-1)
    fused = {
        "rms_norm": cpu_backend().rms_norm(x, weight, 1e-6),
        "add_rms_norm": cpu_backend().add_rms_norm(x, residual, weight, 1e-6),
        "silu_and_mul": cpu_backend().silu_and_mul(gate_up),
        "apply_rotary": cpu_backend().apply_rotary(query.clone(), key.clone(), cos, sin),
    }
    reference = {
        "rms_norm": torch_ref.rms_norm(x, weight, 1e-6),
        "add_rms_norm": torch_ref.add_rms_norm(x, residual, weight, 1e-6),
        "silu_and_mul": torch_ref.silu_and_mul(gate_up),
        "apply_rotary": torch_ref.apply_rotary(query, key, cos, sin),
    }
    for name, expected in reference.items():
        torch.testing.assert_close(fused[name], expected, rtol=2e-6, atol=2e-5, msg=name)


@needs_compiler
def test_fused_cpu_kernels_are_named_in_a_profile():
    with torch.profiler.profile() as profile:
        cpu_backend().silu_and_mul(torch.randn(3, 8))
    assert "infer_recipes::fused_silu_and_mul" in {event.name for event in profile.events()}


def test_fused_cpu_kernels_leave_other_dtypes_and_tracing_to_the_reference(monkeypatch):
    """Whether the fp32 kernels serve is decided when the backend is made; only tracing is seen per call."""
    assert make_backend("cpu", "eager", torch.bfloat16).rms_norm is torch_ref.rms_norm
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.profiler.profile() as profile:
        cpu_backend().rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
    assert not any(event.name.startswith("infer_recipes::") for event in profile.events())


def test_unknown_device_or_exe_mode_is_rejected():
    with pytest.raises(ValueError, match="'tpu'"):
        make_backend("tpu")
    with pytest.raises(ValueError, match="'graph'"):
        make_backend("cpu", "graph")


@pytest.mark.skipif(npu_runtime.npu_is_available(), reason="torch_npu works on this machine")
def test_npu_backend_without_torch_npu_raises_clear_error():
    with pytest.raises(npu_runtime.NpuUnavailableError, match="torch_npu"):
        make_backend("npu")


# A prefill, a decode-like row, a chunk after a cached prefix, a long prefill and a verify step in one
# step: several 32-key tiles and several query tiles per request, q_len < kv_len and q_len == kv_len.
PREFILL_KERNEL_QUERY_LENS, PREFILL_KERNEL_KV_LENS = [37, 1, 5, 70, 3], [37, 20, 70, 70, 90]


def scattered_prefill_step(
    num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """query, the step's key/value and 16-slot caches for the requests above, each over shuffled blocks;
    the cache rows of the step's own positions and of blocks a window has dropped (the null block 0
    in the table) hold NaN, which the kernel must never read."""
    block_size, width = 16, 8
    key_cache = torch.randn(1 + len(PREFILL_KERNEL_KV_LENS) * width, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = (torch.randperm(key_cache.shape[0] - 1) + 1)[: len(PREFILL_KERNEL_KV_LENS) * width]
    block_table = block_table.view(-1, width).to(torch.int32)
    for row, q_len, kv_len in zip(block_table, PREFILL_KERNEL_QUERY_LENS, PREFILL_KERNEL_KV_LENS, strict=True):
        for position in range(kv_len - q_len, kv_len):
            key_cache[row[position // block_size], position % block_size] = float("nan")
        if sliding_window:
            row[: max(0, kv_len - q_len - sliding_window + 1) // block_size] = 0
    key_cache[0] = value_cache[0] = float("nan")
    num_tokens = sum(PREFILL_KERNEL_QUERY_LENS)
    query = 3 * torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)  # peaked softmaxes too
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
    return query, key, value, key_cache, value_cache, block_table


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 2, 80)])
@pytest.mark.parametrize("sliding_window, with_sinks", [(0, False), (3, False), (40, False), (0, True), (40, True)])
def test_cpu_prefill_kernel_matches_the_per_request_reference(
    dtype, num_heads, num_kv_heads, head_dim, sliding_window, with_sinks
):
    """The C++ kernel attends the whole step in one call; it must agree with the torch definition
    (run in fp32 on the same inputs, as the kernel accumulates in fp32) for any grouping, head dim,
    window (smaller than a query too), sinks and storage dtype."""
    assert cpu_kernels.extension() is not None, "the kernel must build where a compiler is present"
    kernel = cpu_kernels.extension().paged_prefill_attention
    tensors = scattered_prefill_step(num_heads, num_kv_heads, head_dim, sliding_window, dtype)
    sinks = torch.randn(num_heads) if with_sinks else None
    query_ends = torch.tensor(PREFILL_KERNEL_QUERY_LENS).cumsum(0)
    seq_lens = torch.tensor(PREFILL_KERNEL_KV_LENS)
    output = kernel(*tensors, query_ends, seq_lens, head_dim**-0.5, sliding_window, sinks, None, None)
    expected = reference.per_request_prefill_attention(
        *(t.float() if t.is_floating_point() else t for t in tensors),
        query_ends.tolist(),
        PREFILL_KERNEL_KV_LENS,
        head_dim**-0.5,
        sliding_window or None,
        sinks,
    )
    assert output.dtype == dtype
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(output.float(), expected, **tolerance)
