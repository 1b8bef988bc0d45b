"""The NPU ops pass the documented torch_npu / torchair arguments (shared/npu-api-facts.md sections 3
and 4), checked against recording stand-ins, since this machine has no NPU.

Shown here: FIA gets the TND paged layout with cumulative query ends and per-request KV lengths
(host lists in eager mode, int64 tensors through torchair in the graph modes); the causal mask and
sparse mode follow the step's longest query (a verify step is causal, a decode step is not); a
sliding window uses the band mode; the KV write, RMSNorm and SwiGLU calls take the documented
arguments; and the NPU backend record imports torch_npu once, when it is made, never during a forward;
and every op of the record has an NPU form but the known gaps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from executor.platform import npu_runtime
from executor.platform.graph_compilers import EXE_MODES
from executor.types_.quant_scheme import QuantArgs
from models.llama import LlamaForCausalLM
from module.attention import Attention
from ops import quant_math, torch_ref
from ops.attention import ATTENTION_KINDS
from ops.attention.metadata import ModelInputs, ScheduledSequence, build_model_inputs, build_step_layout
from ops.attention.npu import NpuAttention, NpuAttentionMetadata, NpuGraphAttention, NpuMetadataBuilder
from ops.backend import NPU_REFERENCE_OPS, OP_NAMES, REFERENCE_OPS, Backend, make_backend
from ops.npu import NpuGraphOps, NpuOps
from tests import attention_layers
from tests.factories import llama_config
from tests.npu_stand_ins import CountingRuntime, GroupedMatmulTorchNpu, RecordingTorchNpu, recording_torchair

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 128, 4, 2, 64
MAX_BLOCKS_PER_REQUEST = 4
SCALE = 0.125
CPU = torch.device("cpu")


def caches() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.zeros(shape), torch.zeros(shape)


def step_kv(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own key and value, which FIA does not read (it reads them from the cache)."""
    shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return torch.zeros(shape), torch.zeros(shape)


# Each step: (cached tokens, tokens fed, blocks) for two requests.
PREFILL = [ScheduledSequence([1] * 3, 0, [[5]]), ScheduledSequence([1] * 5, 0, [[2]])]
DECODE = [ScheduledSequence([1], 130, [[5, 6]]), ScheduledSequence([1], 4, [[2]])]
VERIFY = [  # 3 query tokens per request (2 draft tokens + 1) over a cached prefix: not a prefill, still causal
    ScheduledSequence([1] * 3, 130, [[5, 6]], num_sampled_rows=3),
    ScheduledSequence([1] * 3, 4, [[2]], num_sampled_rows=3),
]


def model_inputs(sequences: list[ScheduledSequence], lengths_as_tensors: bool = False) -> ModelInputs:
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS_PER_REQUEST)
    return build_model_inputs(layout, NpuMetadataBuilder(CPU, lengths_as_tensors=lengths_as_tensors))


def attend(
    attention: NpuAttention, sequences: list[ScheduledSequence], lengths_as_tensors: bool = False, **kwargs: Any
) -> tuple[NpuAttentionMetadata, torch.Tensor]:
    """Run the paged attention over `sequences`; returns the metadata and the block table it was given."""
    inputs = model_inputs(sequences, lengths_as_tensors)
    meta = inputs.forward_metadata
    block_table = meta.groups[0].block_table
    query = torch.zeros(len(inputs.input_ids), NUM_HEADS, HEAD_DIM)
    attention_layers.attend(attention, query, *step_kv(len(query)), *caches(), block_table, meta, SCALE, **kwargs)
    return meta, block_table


def test_prefill_attention_is_tnd_paged_with_cumulative_q_and_per_request_kv():
    torch_npu = RecordingTorchNpu()
    meta = model_inputs(PREFILL).forward_metadata
    block_table = meta.groups[0].block_table
    query = torch.zeros(8, NUM_HEADS, HEAD_DIM)
    attention_layers.attend(NpuAttention(torch_npu), query, *step_kv(8), *caches(), block_table, meta, SCALE)
    (q, k, v), kwargs = torch_npu.last("fia")
    assert q is query and k.shape == v.shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS * HEAD_DIM)
    assert kwargs["input_layout"] == "TND" and kwargs["block_size"] == BLOCK_SIZE
    assert kwargs["actual_seq_lengths"] == [3, 8] and kwargs["actual_seq_lengths_kv"] == [3, 5]
    assert kwargs["block_table"] is block_table and block_table.dtype == torch.int32
    assert block_table.shape == (2, MAX_BLOCKS_PER_REQUEST)
    assert (kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["scale"]) == (NUM_HEADS, NUM_KV_HEADS, SCALE)


def test_prefill_attention_gets_the_int8_2048_causal_mask_with_sparse_mode_3():
    torch_npu = RecordingTorchNpu()
    attend(NpuAttention(torch_npu), PREFILL)
    _, kwargs = torch_npu.last("fia")
    assert kwargs["sparse_mode"] == 3
    mask = kwargs["atten_mask"]
    assert mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert mask[0, 1] == 1 and mask[1, 0] == 0 and mask[0, 0] == 0  # 1 = masked out, above the diagonal
    assert torch.equal(mask, torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1))


def test_verify_step_over_a_cached_prefix_is_causal_with_sparse_mode_3():
    torch_npu = RecordingTorchNpu()
    attend(NpuAttention(torch_npu), VERIFY)
    _, kwargs = torch_npu.last("fia")
    assert kwargs["actual_seq_lengths"] == [3, 6] and kwargs["actual_seq_lengths_kv"] == [133, 7]
    assert kwargs["sparse_mode"] == 3
    assert kwargs["atten_mask"] is not None and kwargs["atten_mask"].shape == (2048, 2048)


def test_decode_attention_reads_per_request_kv_lengths_without_a_mask():
    torch_npu = RecordingTorchNpu()
    attend(NpuAttention(torch_npu), DECODE)
    _, kwargs = torch_npu.last("fia")
    assert kwargs["actual_seq_lengths"] == [1, 2] and kwargs["actual_seq_lengths_kv"] == [131, 5]
    assert kwargs["atten_mask"] is None and kwargs["sparse_mode"] == 0


def test_eager_fia_gets_host_lists():
    torch_npu = RecordingTorchNpu()
    attend(NpuAttention(torch_npu), DECODE, lengths_as_tensors=False)
    _, kwargs = torch_npu.last("fia")
    assert type(kwargs["actual_seq_lengths"]) is list and type(kwargs["actual_seq_lengths_kv"]) is list


@pytest.mark.parametrize("sequences", [PREFILL, DECODE, VERIFY], ids=["prefill", "decode", "verify"])
def test_graph_fia_goes_through_torchair_with_int64_length_tensors(sequences):
    torch_npu, torchair = RecordingTorchNpu(), recording_torchair()
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS_PER_REQUEST)
    attend(NpuGraphAttention(torch_npu, torchair), sequences, lengths_as_tensors=True)
    assert "fia" not in torch_npu.calls  # the eager kernel is never called in a graph mode
    _, kwargs = torchair.ops.last("fia")
    for name, expected in (("actual_seq_lengths", layout.query_ends), ("actual_seq_lengths_kv", layout.seq_lens)):
        lengths = kwargs[name]
        assert isinstance(lengths, torch.Tensor) and lengths.dtype == torch.int64, name
        assert lengths.tolist() == expected, name
    assert kwargs["input_layout"] == "TND" and kwargs["block_table"].dtype == torch.int32


def test_sliding_window_prefill_uses_the_band_mode_with_the_window_before_and_nothing_after():
    torch_npu = RecordingTorchNpu()
    attend(NpuAttention(torch_npu), PREFILL, sliding_window=4)
    _, kwargs = torch_npu.last("fia")
    assert (kwargs["sparse_mode"], kwargs["pre_tokens"], kwargs["next_tokens"]) == (4, 4, 0)
    assert kwargs["atten_mask"] is not None and kwargs["atten_mask"].shape == (2048, 2048)


def test_full_attention_leaves_pre_and_next_tokens_unlimited():
    torch_npu = RecordingTorchNpu()
    attend(NpuAttention(torch_npu), PREFILL)
    _, kwargs = torch_npu.last("fia")
    assert kwargs["pre_tokens"] == kwargs["next_tokens"] == 2147483647


def test_kv_write_uses_the_nd_cache_mode_and_contiguous_inputs():
    torch_npu = RecordingTorchNpu()
    key_cache, value_cache = caches()
    key = torch.zeros(NUM_KV_HEADS, 3, HEAD_DIM).transpose(0, 1)  # non-contiguous on purpose
    slots = torch.tensor([0, 1, 2])
    attention_layers.write_kv(NpuAttention(torch_npu), key, key, key_cache, value_cache, slots)
    args, kwargs = torch_npu.last("scatter")
    assert kwargs == {"cache_mode": "Norm"}
    assert args[0].is_contiguous() and args[1].is_contiguous()
    assert torch.equal(args[0], key)
    assert args[2] is key_cache and args[3] is value_cache and args[4] is slots


def test_rms_norm_takes_the_first_output():
    torch_npu = RecordingTorchNpu()
    x = torch.ones(2, 4)
    assert torch.equal(NpuOps(torch_npu).rms_norm(x, torch.ones(4), 1e-5), x * 2)
    assert torch_npu.last("rms_norm")[0][2] == 1e-5


def test_add_rms_norm_returns_the_norm_and_the_new_residual():
    torch_npu = RecordingTorchNpu()
    x, residual = torch.ones(2, 4), torch.full((2, 4), 2.0)
    normed, new_residual = NpuOps(torch_npu).add_rms_norm(x, residual, torch.ones(4), 1e-5)
    assert torch.equal(normed, (x + residual) * 2) and torch.equal(new_residual, x + residual)


def test_swiglu_splits_the_last_dim():
    torch_npu = RecordingTorchNpu()
    assert NpuOps(torch_npu).silu_and_mul(torch.ones(2, 8)).shape == (2, 4)
    assert torch_npu.last("swiglu")[1] == {"dim": -1}


@pytest.mark.parametrize(("head_dim", "fused"), [(64, True), (128, True), (32, False)])
def test_rotary_uses_the_fused_kernel_only_for_head_dims_64_and_128(head_dim, fused):
    torch_npu = RecordingTorchNpu()
    query, key = torch.zeros(5, NUM_HEADS, head_dim), torch.zeros(5, NUM_KV_HEADS, head_dim)
    cos, sin = torch.ones(5, head_dim), torch.zeros(5, head_dim)
    rotated_q, rotated_k = NpuOps(torch_npu).apply_rotary(query, key, cos, sin)
    assert rotated_q.shape == query.shape and rotated_k.shape == key.shape
    assert ("apply_rotary_pos_emb" in torch_npu.calls) is fused and ("rotary_mul" in torch_npu.calls) is not fused
    if fused:  # BSND with B = 1: q [1, T, H, D], cos [1, T, 1, D]
        q, k, cos_arg, _ = torch_npu.last("apply_rotary_pos_emb")[0]
        assert q.shape == (1, 5, NUM_HEADS, head_dim) and k.shape == (1, 5, NUM_KV_HEADS, head_dim)
        assert cos_arg.shape == (1, 5, 1, head_dim)


@pytest.fixture
def runtime(monkeypatch) -> Iterator[CountingRuntime]:
    counting = CountingRuntime()
    monkeypatch.setattr(npu_runtime, "torch_npu", counting.torch_npu)
    monkeypatch.setattr(npu_runtime, "torchair", counting.torchair)
    yield counting


def npu_ops_of(backend: Backend) -> NpuOps:
    """The NpuOps object whose methods the record holds."""
    return backend.rms_norm.__self__


@pytest.mark.parametrize("exe_mode", EXE_MODES)
def test_npu_op_table_imports_torch_npu_once_and_matches_ops_and_builder_to_the_mode(runtime, exe_mode):
    backend = make_backend("npu", exe_mode)
    graph = exe_mode != "eager"
    assert runtime.torch_npu_calls == 1 and runtime.torchair_calls == int(graph)
    assert backend.name == ("npu_graph" if graph else "npu")
    assert type(npu_ops_of(backend)) is (NpuGraphOps if graph else NpuOps)
    assert type(backend.attention) is (NpuGraphAttention if graph else NpuAttention)
    assert backend.attention.torch_npu is runtime.torch_npu_module
    assert npu_ops_of(backend).torch_npu is runtime.torch_npu_module
    if graph:
        assert npu_ops_of(backend).torchair is runtime.torchair_module
    builder = backend.metadata_builder(CPU)
    assert isinstance(builder, NpuMetadataBuilder) and builder.lengths_as_tensors is graph


def test_every_mode_imports_torch_npu_once_per_process_through_the_runtime(monkeypatch):
    """The real helpers: torchair() goes through the cached torch_npu(), so torch_npu is imported once."""
    modules = {"torch_npu": RecordingTorchNpu(), "torchair": recording_torchair()}
    imported: list[str] = []

    def import_module(name: str) -> Any:
        imported.append(name)
        return modules[name]

    monkeypatch.setattr(npu_runtime, "is_torch_npu_installed", lambda: True)
    monkeypatch.setattr(npu_runtime.importlib, "import_module", import_module)
    npu_runtime.torch_npu.cache_clear()
    try:
        backends = [make_backend("npu", mode) for mode in EXE_MODES]
    finally:
        npu_runtime.torch_npu.cache_clear()
    assert imported.count("torch_npu") == 1 and imported.count("torchair") == len(EXE_MODES) - 1
    assert all(npu_ops_of(backend).torch_npu is modules["torch_npu"] for backend in backends)


# Ops (and attention forms) with a torch reference only so far: the NPU record lacks them, and models
# needing them are refused.
KNOWN_NPU_GAPS = {
    "write_latent_cache",
    "mla_attention",
    "moe_experts",
    "paged_attention_with_sinks",
    "moe_experts_clamped_swiglu",
    "clamped_silu_and_mul",
    "moe_experts_clamped_silu",
    "moe_experts_gelu_tanh",
    "indexer_topk",  # DSA: no indexer or sparse-attention operator in shared/npu-api-facts.md
    "sparse_mla_attention",
}


@pytest.mark.parametrize("exe_mode", EXE_MODES)
def test_every_op_has_an_npu_implementation_but_the_known_gaps(runtime, exe_mode):
    """Over the record's real op fields: a new op without an NPU form fails here until it gets one
    (or is listed as a gap)."""
    backend = make_backend("npu", exe_mode)
    assert set(backend.missing((*OP_NAMES, *ATTENTION_KINDS))) == KNOWN_NPU_GAPS
    for name in set(OP_NAMES) - KNOWN_NPU_GAPS - set(NPU_REFERENCE_OPS):
        assert getattr(backend, name).__self__ is npu_ops_of(backend), f"{name} is not the NPU's"
    for name in NPU_REFERENCE_OPS:  # no NPU form in npu-api-facts.md: the torch reference runs
        assert getattr(backend, name) is REFERENCE_OPS[name]


def tiny_llama(backend: Backend) -> LlamaForCausalLM:
    config = llama_config(num_hidden_layers=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=512)
    model = LlamaForCausalLM(config, backend=backend)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    for attention in (m for m in model.modules() if isinstance(m, Attention)):
        shape = (NUM_BLOCKS, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
        attention.bind_kv_cache({"key": torch.zeros(shape), "value": torch.zeros(shape)}, group_id=0)
    return model


@pytest.mark.parametrize("exe_mode", EXE_MODES)
@torch.no_grad()
def test_forward_passes_never_call_the_torch_npu_import_helper(runtime, exe_mode):
    table = make_backend("npu", exe_mode)
    model = tiny_llama(table)
    for sequences in (PREFILL, DECODE, VERIFY):
        layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS_PER_REQUEST)
        inputs = build_model_inputs(layout, table.metadata_builder(CPU))
        hidden_states = model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        assert hidden_states.shape == (len(layout.input_ids), 64)
    fia_calls = runtime.torchair_module.ops if exe_mode != "eager" else runtime.torch_npu_module
    assert len(fia_calls.calls["fia"]) == 3 * 2  # every layer of every step went through the NPU table
    assert runtime.torch_npu_calls == 1


@pytest.mark.parametrize("static", [False, True])
def test_int8_experts_run_as_two_grouped_matmuls_with_per_channel_and_per_token_scales(static):
    """NpuOps.moe_experts_int8 over a stand-in that computes npu_grouped_matmul as its doc says:
    the reference's output (1e-5), rows sorted by expert with their counts as group_list."""
    generator = torch.Generator().manual_seed(0)
    tokens, experts, hidden, inter = 10, 4, 16, 8
    hidden_states = torch.randn(tokens, hidden, generator=generator)
    topk_ids = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, 2, generator=generator)
    stacks = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        parts = [
            quant_math.quantize_weight(torch.randn(rows, cols, generator=generator), QuantArgs(8))
            for _ in range(experts)
        ]
        stacks += [
            torch.stack([p[0] for p in parts]).transpose(1, 2).contiguous(),
            torch.stack([p[1][:, 0] for p in parts]),
        ]
    scales = (
        (torch.rand(experts, generator=generator) * 0.05 + 0.01, torch.rand(experts, generator=generator) * 0.05 + 0.01)
        if static
        else (None, None)
    )
    torch_npu = GroupedMatmulTorchNpu()
    ours = NpuOps(torch_npu).moe_experts_int8(hidden_states, topk_weights, topk_ids, *stacks, *scales)
    reference = torch_ref.moe_experts_int8(hidden_states, topk_weights, topk_ids, *stacks, *scales)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    (_, weights), kwargs = torch_npu.last("grouped_matmul")
    assert kwargs["group_list"].tolist() == torch.bincount(topk_ids.flatten(), minlength=experts).tolist()
    assert weights[0].dtype == torch.int8 and kwargs["scale"][0].shape == (experts, hidden)
