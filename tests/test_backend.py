"""The backend record (ops/backend.py): what make_backend picks per (device, exe_mode, dtype), the
CPU backend's fallbacks (decided when it is made) and shape guards (per call), the CUDA graph
backend's decode attention, and the refusal of a model whose backend lacks an op it needs."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

from executor.platform.graph_compilers import GRAPH_COMPILERS
from executor.types_.quant_scheme import FP8, QUANTIZED_KINDS, W8A8_INT8
from models.qwen3_moe.model import Qwen3MoeForCausalLM
from ops import cpu_kernels, torch_ref
from ops.attention import ATTENTION_KINDS
from ops.attention.cpu import CpuAttention
from ops.attention.cuda_graph import CudaGraphAttention
from ops.attention.metadata import TorchMetadataBuilder
from ops.attention.reference import ReferenceAttention, gathered_decode_attention, paged_decode_attention
from ops.backend import OP_NAMES, REFERENCE_OPS, make_backend
from ops.cpu import CpuOps
from ops.cpu_quantized import VnniInt8Linear
from ops.linear_method import PlainLinear
from ops.quantized_linear import DequantizedLinear, Int8ScaledLinear
from tests.attention_layers import write_kv
from tests.backends import cpu_backend
from tests.factories import qwen_config


def is_cpu_kernel(op: object) -> bool:
    return isinstance(getattr(op, "__self__", None), CpuOps)


def test_cpu_fp32_takes_every_cpu_kernel_and_bf16_only_the_dtype_free_ones():
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels do not build here")
    fp32, bf16 = make_backend("cpu", "eager", torch.float32), make_backend("cpu", "eager", torch.bfloat16)
    kernels = {"rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul", "argmax_rows"}
    fp32_only = {"rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul", "moe_experts"}
    kernels |= {"moe_experts"}  # the reference's grouping with the fused SiLU-and-mul
    assert {name for name in OP_NAMES if is_cpu_kernel(getattr(fp32, name))} == kernels
    assert {name for name in OP_NAMES if is_cpu_kernel(getattr(bf16, name))} == kernels - fp32_only
    assert bf16.moe_experts is torch_ref.moe_experts and bf16.rms_norm is torch_ref.rms_norm
    assert fp32.moe_experts_clamped_swiglu is torch_ref.moe_experts_clamped_swiglu
    # the K/V and latent writes, paged attention with and without sinks, and MLA: the CPU's attention,
    # MLA's absorbed decode (the reference's) over the C++ decode kernel, in either dtype
    for backend in (fp32, bf16):
        assert isinstance(backend.attention, CpuAttention) and backend.attention.kinds == ATTENTION_KINDS
        assert backend.attention.decode_attention is cpu_kernels.extension().paged_decode_attention
    assert fp32.name == "cpu" and fp32.graph_compiler is None


def test_without_the_extension_the_cpu_backend_is_the_reference(monkeypatch):
    """Decided once, when the record is made: the ops are the reference's own functions."""
    monkeypatch.setattr(cpu_kernels, "extension", lambda: None)
    backend = make_backend("cpu", "eager", torch.float32)
    assert all(getattr(backend, name) is REFERENCE_OPS[name] for name in OP_NAMES)
    assert (
        type(backend.attention) is ReferenceAttention and backend.attention.decode_attention is paged_decode_attention
    )
    assert not isinstance(backend.linear_method(), type(None))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("exe_mode", ["eager", "ge_graph", "npugraph_ex"])
def test_each_exe_mode_gets_its_devices_graph_compiler(device_type, exe_mode):
    backend = make_backend(device_type, exe_mode, torch.float32)
    assert backend.device_type == device_type and backend.exe_mode == exe_mode
    assert backend.graph_compiler is GRAPH_COMPILERS.get((device_type, exe_mode))
    assert isinstance(backend.metadata_builder(torch.device("cpu")), TorchMetadataBuilder)


def test_cuda_graph_mode_takes_the_capacity_decode_and_eager_cuda_the_reference():
    eager, graph = make_backend("cuda", "eager"), make_backend("cuda", "npugraph_ex")
    assert eager.name == "cuda" and all(getattr(eager, name) is REFERENCE_OPS[name] for name in OP_NAMES)
    assert type(eager.attention) is ReferenceAttention
    assert graph.name == "cuda_graph" and graph.rms_norm is torch_ref.rms_norm
    # paged attention with and without sinks and MLA: the reference's, over the capacity decode
    assert isinstance(graph.attention, CudaGraphAttention) and graph.attention.kinds == ATTENTION_KINDS
    assert graph.attention.decode_attention is gathered_decode_attention
    assert graph.indexer_topk is None  # it reads each request's length on the host: no captured form
    assert isinstance(eager.linear_method(), PlainLinear) and isinstance(graph.linear_method(), PlainLinear)
    assert make_backend("cuda", "ge_graph").name == "cuda"  # inductor: the custom op reads the lengths at run time


def test_cuda_graph_decode_attention_gathers_the_table_capacity_and_reads_no_length():
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 8
    key_cache = torch.randn(32, block_size, kv_heads, head_dim)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(2, heads, head_dim)
    block_table = torch.tensor([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 3])
    args = (query, key_cache, value_cache, block_table, seq_lens, 0.3, 0, None)
    with torch.profiler.profile(record_shapes=True) as profile:
        out = CudaGraphAttention().decode_attention(*args)
    torch.testing.assert_close(out, paged_decode_attention(*args))
    index_shapes = [e.input_shapes[2] for e in profile.events() if e.name == "aten::index_select"]
    assert index_shapes == [[2 * 5 * block_size]] * 2  # K and V: 2 requests x the table's 20 slots
    assert not any(e.name in ("aten::item", "aten::_local_scalar_dense") for e in profile.events())


class RecordingKernels:
    """The extension's fused kernels, recording which were called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def kernel(*args: object) -> object:
            self.calls.append(name)
            return getattr(torch_ref, name.removeprefix("fused_"))(*args) if name.startswith("fused_") else None

        return kernel


def test_the_cpu_wrappers_fall_back_to_the_reference_where_the_shapes_do_not_fit():
    kernels = RecordingKernels()
    ops = CpuOps(kernels)
    x, weight = torch.randn(4, 8), torch.ones(8)
    ops.rms_norm(x, weight, 1e-6)
    ops.rms_norm(x.t().contiguous().t(), weight, 1e-6)  # a transposed layout: the reference
    ops.add_rms_norm(x, x, weight, 1e-6)
    ops.add_rms_norm(x, x[:1].expand(4, 8), weight, 1e-6)  # a broadcast residual: the reference
    ops.silu_and_mul(torch.randn(4, 16)[:, ::2])  # strided: the reference
    query, key, cos = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 8)
    ops.apply_rotary(query, key, cos, cos)
    ops.apply_rotary(query, key, cos, cos.t().contiguous().t())  # cos and sin strided differently
    caches = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    write_kv(CpuAttention(kernels), key, key, *caches, torch.tensor([0, 1, 2]))
    assert kernels.calls == ["fused_rms_norm", "fused_add_rms_norm", "fused_apply_rotary", "write_kv_cache"]


def test_the_cpu_wrappers_leave_tracing_to_the_reference(monkeypatch):
    kernels = RecordingKernels()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    CpuOps(kernels).silu_and_mul(torch.randn(2, 8))
    assert kernels.calls == []


def test_a_model_needing_an_op_its_backend_lacks_is_refused_when_built_naming_the_op():
    backend = dataclasses.replace(cpu_backend(), name="partial", moe_experts=None)
    assert backend.missing(OP_NAMES) == ["moe_experts"]
    with pytest.raises(NotImplementedError, match="routed experts needs ops moe_experts, which the partial backend"):
        Qwen3MoeForCausalLM(qwen_config("qwen3_moe"), backend=backend)


def test_a_scheme_without_a_linear_method_is_refused():
    with pytest.raises(NotImplementedError, match="no linear method for 'nvfp4'"):
        cpu_backend().linear_method("nvfp4")


def test_every_record_has_a_method_for_every_quantized_kind_int8_natively_on_cpu_and_cuda():
    cpu = cpu_backend()
    assert set(QUANTIZED_KINDS) <= set(cpu.linear)
    assert isinstance(cpu.linear_method(W8A8_INT8), (Int8ScaledLinear, VnniInt8Linear))
    assert isinstance(cpu.linear_method(FP8), DequantizedLinear)
    assert cpu.linear_method(FP8).dense is cpu.linear_method()  # dequantized weights packed as plain ones are
    cuda = make_backend("cuda")
    assert isinstance(cuda.linear_method(W8A8_INT8), Int8ScaledLinear)


def test_the_record_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu_backend().rms_norm = SimpleNamespace()


def test_the_cpu_experts_with_the_fused_activation_equal_the_reference():
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels do not build here")
    generator = torch.Generator().manual_seed(0)
    num_tokens, hidden, intermediate, num_experts, top_k = 9, 16, 12, 4, 2
    hidden_states = torch.randn(num_tokens, hidden, generator=generator)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    topk_weights = torch.rand(num_tokens, top_k, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, intermediate, generator=generator)
    args = (hidden_states, topk_weights, topk_ids, gate_up, down)
    torch.testing.assert_close(cpu_backend().moe_experts(*args), torch_ref.moe_experts(*args))


@pytest.mark.parametrize("build_s, announced", [(1.0, True), (0.0, False)])
def test_a_slow_kernel_build_is_announced_and_a_cached_load_is_not(monkeypatch, caplog, build_s, announced):
    def load_inline(**kwargs: object) -> object:
        time.sleep(build_s)
        return SimpleNamespace()

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    monkeypatch.setattr(cpu_kernels, "BUILD_NOTICE_AFTER_S", 0.1)
    with caplog.at_level("INFO", logger=cpu_kernels.__name__):
        assert cpu_kernels.extension.__wrapped__() is not None  # the uncached function
    messages = [record.getMessage() for record in caplog.records]
    assert any("building the CPU kernels" in message for message in messages) == announced
    assert any(message.startswith("building the CPU kernels") and "done in" in message for message in messages) is (
        announced
    )
