"""The backend record: per (device, exe_mode), the one place that says what runs.

Every op is a field (None where the backend has no form of it), beside the linear methods by weight
scheme, the attention backend (ops/attention/: the paged K/V's and MLA's cache writes and attention),
its metadata builder and the graph compiler. make_backend picks the record and
decides, once, what the machine allows: whether the CPU's C++ extension built, which linear layout
the CPU's flags call for, whether the model's dtype suits the fused fp32 kernels. Models get the
record at construction and their layers call its fields directly; nothing is switched globally.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from executor.platform import npu_runtime
from executor.platform.graph_compilers import GraphCompilerFactory, graph_compiler_factory
from executor.types_.quant_scheme import QUANTIZED_KINDS, W8A8_INT8, WNA16
from ops import compressed_kv, cpu, cpu_kernels, cuda_quant, kda, recurrent_ref, sparse_attention, torch_ref
from ops.attention import ATTENTION_KINDS, AttentionBackend
from ops.attention.cpu import CpuAttention
from ops.attention.cuda_graph import CudaGraphAttention
from ops.attention.metadata import AttentionMetadataBuilder, TorchMetadataBuilder
from ops.attention.npu import NpuAttention, NpuGraphAttention, NpuMetadataBuilder
from ops.attention.reference import ReferenceAttention
from ops.cpu import CpuOps, cpu_linear_method
from ops.cpu_quantized import (
    AUTO_ACTIVATIONS,
    VNNI_FLAGS,
    CpuInt8Kernels,
    Int16MaddInt8Linear,
    VnniInt8Linear,
    Wna16Linear,
)
from ops.linear_method import PLAIN, UNQUANTIZED, LinearMethod
from ops.npu import NpuGraphOps, NpuOps
from ops.npu_quant import npu_linear_methods
from ops.quantized_experts import DEQUANTIZED_EXPERTS, INT8_EXPERTS, ExpertsMethod
from ops.quantized_linear import DequantizedLinear, Int8ScaledLinear
from ops.signatures import (
    AddNormOp,
    ArgmaxOp,
    BiasedClampedExpertsOp,
    CausalConvOp,
    ClampedActivationOp,
    ClampedExpertsOp,
    CompressedIndexerTopkOp,
    CompressedKVAttentionOp,
    ExpertsOp,
    GatedActivationOp,
    GatedDeltaRuleOp,
    GatedNormOp,
    IndexerTopkOp,
    Int8ExpertsOp,
    KdaOp,
    NormOp,
    RotaryOp,
    SparseMlaOp,
)

DEVICE_TYPES = ("cpu", "cuda", "npu")
Op = Callable[..., object]  # any op: a record field's value, before the record types it


def _op() -> Any:
    """A field that holds one op, typed by its kind (ops/signatures.py), or None where the backend has no
    form of it: a layer calls only the ops it required (Backend.require) when it was built."""
    return field(default=None, metadata={"op": True})


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: its fields are callables
class Backend:
    name: str  # "cpu", "cuda", "cuda_graph", "npu" or "npu_graph"
    device_type: str
    exe_mode: str
    # the model's dtype, handed to its layers: what they allocate their K/V caches and conv states in
    # (a C8 cache is int8 whatever it is; recurrent states stay fp32)
    dtype: torch.dtype
    linear: Mapping[str, LinearMethod]  # weight scheme -> its method
    metadata_builder: Callable[[torch.device], AttentionMetadataBuilder]
    graph_compiler: GraphCompilerFactory | None  # None: eager
    # the device's attention (ops/attention/): the paged K/V's and MLA's cache writes and attention
    attention: AttentionBackend
    argmax_rows: ArgmaxOp = _op()  # the greedy choice: each row's first maximum (the sampler's, MTP's drafts)
    rms_norm: NormOp = _op()
    add_rms_norm: AddNormOp = _op()
    apply_rotary: RotaryOp = _op()
    silu_and_mul: GatedActivationOp = _op()
    clamped_silu_and_mul: ClampedActivationOp = _op()
    gelu_tanh_and_mul: GatedActivationOp = _op()
    indexer_topk: IndexerTopkOp = _op()  # DSA's lightning indexer: scores over the paged indexer keys, top-k
    sparse_mla_attention: SparseMlaOp = _op()  # DSA: MLA over the indexer's selected tokens only
    moe_experts: ExpertsOp = _op()
    moe_experts_clamped_swiglu: BiasedClampedExpertsOp = _op()
    moe_experts_clamped_silu: ClampedExpertsOp = _op()
    moe_experts_clamped_gate_silu: ClampedExpertsOp = _op()  # DeepSeek-V4's experts
    # DeepSeek-V4's sliding + compressed KV (ops/compressed_kv.py)
    compressed_kv_attention: CompressedKVAttentionOp = _op()
    compressed_indexer_topk: CompressedIndexerTopkOp = _op()  # DeepSeek-V4's lightning indexer over compressed entries
    moe_experts_gelu_tanh: ExpertsOp = _op()
    moe_experts_int8: Int8ExpertsOp = _op()  # W8A8 int8 experts (ops/quantized_experts.py's Int8Experts)
    # linear attention (ops/recurrent_ref.py): the short conv and the gated delta rule over state slots
    causal_conv1d_fn: CausalConvOp = _op()
    causal_conv1d_update: CausalConvOp = _op()
    chunk_gated_delta_rule: GatedDeltaRuleOp = _op()
    recurrent_gated_delta_rule: GatedDeltaRuleOp = _op()
    rms_norm_gated: GatedNormOp = _op()
    # Kimi delta attention over state slots (ops/kda.py): prompts, and one token per row
    chunk_kda: KdaOp = _op()
    recurrent_kda: KdaOp = _op()

    def missing(self, op_names: tuple[str, ...]) -> list[str]:
        """Which of `op_names` (ops, or the attention's forms: ATTENTION_KINDS) this backend has no form of."""
        return [
            name
            for name in op_names
            if (name not in self.attention.kinds if name in ATTENTION_KINDS else getattr(self, name) is None)
        ]

    def require(self, op_names: tuple[str, ...], who: str) -> None:
        """Refuse `who` (a model or layer being built) if it needs an op this backend lacks."""
        missing = self.missing(op_names)
        if missing:
            raise NotImplementedError(
                f"{who} needs ops {', '.join(missing)}, which the {self.name} backend does not have yet; "
                "run it on cpu or cuda"
            )

    def linear_method(self, scheme: str = UNQUANTIZED) -> LinearMethod:
        try:
            return self.linear[scheme]
        except KeyError:
            raise NotImplementedError(f"the {self.name} backend has no linear method for {scheme!r} weights") from None

    def dequantized_linear(self) -> LinearMethod:
        """Any quantized kind computed plainly over the dense method: for a layer whose dense weight
        another op reads (MLA's kv_b_proj, absorbed into the attention)."""
        return DequantizedLinear(self.linear_method())

    def experts_method(self, kind: str) -> ExpertsMethod:
        """Routed experts of weight kind `kind`: native int8 where the record has the op, else dequantized."""
        return INT8_EXPERTS if kind == W8A8_INT8 and self.moe_experts_int8 is not None else DEQUANTIZED_EXPERTS


OP_NAMES = tuple(f.name for f in dataclasses.fields(Backend) if f.metadata.get("op"))


def linear_methods(dense: LinearMethod, native: Mapping[str, LinearMethod], device: str) -> Mapping[str, LinearMethod]:
    """Every weight kind's method: `dense` for unquantized weights, `native` kernels where the backend
    has them, and elsewhere the scheme computed plainly over `dense` (weights dequantized at load,
    the log saying "no native fp8 matmul on cpu")."""
    plainly = {kind: DequantizedLinear(dense, f"no native {kind} matmul on {device}") for kind in QUANTIZED_KINDS}
    return MappingProxyType({UNQUANTIZED: dense, **plainly, **native})


# The linear-attention ops: no fused form in torch, torch_npu's facts (../shared/npu-api-facts.md) or the
# CPU's kernels yet, so every record runs their reference.
RECURRENT_OPS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "rms_norm_gated",
    "chunk_kda",
    "recurrent_kda",
)
COMPRESSED_KV_OPS = ("compressed_kv_attention", "compressed_indexer_topk")
# The torch reference of every op, in one table: ops/torch_ref.py's, the linear attentions' (ops/recurrent_ref.py,
# ops/kda.py), DSA's (ops/sparse_attention.py) and DeepSeek-V4's compressed KV (ops/compressed_kv.py).
REFERENCE_OPS: Mapping[str, Op] = MappingProxyType(
    {
        "argmax_rows": torch_ref.argmax_rows,
        "rms_norm": torch_ref.rms_norm,
        "add_rms_norm": torch_ref.add_rms_norm,
        "apply_rotary": torch_ref.apply_rotary,
        "silu_and_mul": torch_ref.silu_and_mul,
        "clamped_silu_and_mul": torch_ref.clamped_silu_and_mul,
        "gelu_tanh_and_mul": torch_ref.gelu_tanh_and_mul,
        "indexer_topk": sparse_attention.indexer_topk,
        "sparse_mla_attention": sparse_attention.sparse_mla_attention,
        "moe_experts": torch_ref.moe_experts,
        "moe_experts_clamped_swiglu": torch_ref.moe_experts_clamped_swiglu,
        "moe_experts_clamped_silu": torch_ref.moe_experts_clamped_silu,
        "moe_experts_clamped_gate_silu": torch_ref.moe_experts_clamped_gate_silu,
        "compressed_kv_attention": compressed_kv.compressed_kv_attention,
        "compressed_indexer_topk": compressed_kv.compressed_indexer_topk,
        "moe_experts_gelu_tanh": torch_ref.moe_experts_gelu_tanh,
        "moe_experts_int8": torch_ref.moe_experts_int8,
        "causal_conv1d_fn": recurrent_ref.causal_conv1d_fn,
        "causal_conv1d_update": recurrent_ref.causal_conv1d_update,
        "chunk_gated_delta_rule": recurrent_ref.chunk_gated_delta_rule,
        "recurrent_gated_delta_rule": recurrent_ref.recurrent_gated_delta_rule,
        "rms_norm_gated": recurrent_ref.rms_norm_gated,
        "chunk_kda": kda.chunk_kda,
        "recurrent_kda": kda.recurrent_kda,
    }
)
assert set(REFERENCE_OPS) == set(OP_NAMES), "every op field has its reference, and only those"
# Ops no device has a form of in shared/npu-api-facts.md: the NPU record runs their torch reference (the
# greedy argmax's is aten's max, an NPU op through torch_npu).
NPU_REFERENCE_OPS = (*RECURRENT_OPS, *COMPRESSED_KV_OPS, "moe_experts_clamped_gate_silu", "argmax_rows")


def make_backend(
    device_type: str,
    exe_mode: str = "eager",
    dtype: torch.dtype = torch.float32,
    *,
    prepack_weights: bool = True,
    cpu_extension: bool = True,
    wna16_activations: str = AUTO_ACTIVATIONS,
) -> Backend:
    """The record for (device_type, exe_mode) with a model of `dtype`. `prepack_weights` (CPU only)
    lays linear weights out for the CPU's kernels; `cpu_extension` False keeps the C++ kernels out
    (the reference runs); `wna16_activations` (CPU only) is how the few-row 4/8-bit kernel multiplies
    (ops/cpu_quantized.py's Wna16Linear). NPU records import torch_npu (and torchair for graph modes) now, so a bad
    install fails here with the reason, not mid-run."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type must be one of {list(DEVICE_TYPES)}, got {device_type!r}")
    compiler = graph_compiler_factory(device_type, exe_mode)
    common: dict[str, Any] = {
        "device_type": device_type,
        "exe_mode": exe_mode,
        "dtype": dtype,
        "graph_compiler": compiler,
    }
    if device_type == "cpu":
        return _cpu_backend(dtype, prepack_weights, cpu_extension, wna16_activations, common)
    if device_type == "cuda":
        captured = exe_mode == "npugraph_ex"  # CUDA graphs (executor/platform/graph_compilers.py)
        # DSA's indexer reads each request's length to score only its tokens: no captured form yet
        ops: dict[str, Any] = {**REFERENCE_OPS, **({"indexer_topk": None} if captured else {})}
        attention = CudaGraphAttention() if captured else ReferenceAttention()
        linear = linear_methods(PLAIN, cuda_quant.cuda_linear_methods(cuda_quant.device_capability(), PLAIN), "cuda")
        return Backend(
            attention.name if captured else "cuda",
            linear=linear,
            metadata_builder=TorchMetadataBuilder,
            attention=attention,
            **common,
            **ops,
        )
    return _npu_backend(exe_mode, common)


def _cpu_backend(
    dtype: torch.dtype, prepack_weights: bool, use_extension: bool, wna16_activations: str, common: dict[str, Any]
) -> Backend:
    kernels = cpu_kernels.extension() if use_extension else None
    ops: dict[str, Any] = dict(REFERENCE_OPS)
    attention: AttentionBackend = ReferenceAttention()
    if kernels is not None:
        cpu_ops = CpuOps(kernels)
        fp32_only = ("rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul", "moe_experts")
        names = ("argmax_rows", *(fp32_only if dtype == torch.float32 else ()))
        ops.update({name: getattr(cpu_ops, name) for name in names})
        attention = CpuAttention(kernels)
    packed = cpu_linear_method(dtype, kernels, cpu_kernels.cpu_flags()) if prepack_weights else None
    dense = packed or PLAIN
    linear = linear_methods(dense, _cpu_quantized_methods(kernels, dense, dtype, wna16_activations), "cpu")
    return Backend("cpu", linear=linear, metadata_builder=TorchMetadataBuilder, attention=attention, **common, **ops)


def _cpu_quantized_methods(
    kernels: object | None, dense: LinearMethod, dtype: torch.dtype, wna16_activations: str
) -> dict[str, LinearMethod]:
    """W8A8 by the one-kernel int8 linear on fp32 models where the CPU has AVX-512 VNNI, by the int16
    vpmaddwd matmul where it has AVX2 without VNNI (oneDNN's int8 product is a reference loop there),
    else by torch._int_mm; between the one-pass kernels of ops/cpu_quantized.py (the plain-torch
    quantize and rescale where the extension did not build); WNA16 by the few-row 4/8-bit kernels."""
    if kernels is None:
        return {W8A8_INT8: Int8ScaledLinear(cpu.int8_mm, "torch._int_mm, oneDNN")}
    flags = cpu_kernels.cpu_flags()
    if dtype == torch.float32 and VNNI_FLAGS <= flags:
        w8a8: LinearMethod = VnniInt8Linear(kernels)
    elif "avx2" in flags and not VNNI_FLAGS <= flags:
        w8a8 = Int16MaddInt8Linear(kernels)
    else:
        int8 = CpuInt8Kernels(kernels)
        w8a8 = Int8ScaledLinear(cpu.int8_mm, "torch._int_mm, oneDNN", int8.quantize, int8.rescale)
    return {
        W8A8_INT8: w8a8,
        WNA16: Wna16Linear(
            kernels, DequantizedLinear(dense, "no CPU kernel for its groups or dtype"), wna16_activations
        ),
    }


# The ops ops/npu.py implements. The others have a torch reference only so far (MLA and MoE for
# DeepSeek-V3; attention sinks and biased clamped-SwiGLU experts for gpt-oss; the clamped SiLU-and-mul,
# dense and in experts, for Step-3.7-Flash; GeGLU experts for Gemma 4): None in the NPU record, so a
# model needing them is refused there when it is built.
NPU_OPS = (
    "rms_norm",
    "add_rms_norm",
    "apply_rotary",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "moe_experts_int8",
)


def _npu_backend(exe_mode: str, common: dict[str, Any]) -> Backend:
    graph = exe_mode != "eager"
    torch_npu = npu_runtime.torch_npu()
    npu_ops: NpuOps
    attention: AttentionBackend
    if graph:
        torchair = npu_runtime.torchair()
        npu_ops, attention = NpuGraphOps(torch_npu, torchair), NpuGraphAttention(torch_npu, torchair)
    else:
        npu_ops, attention = NpuOps(torch_npu), NpuAttention(torch_npu)
    metadata_builder = functools.partial(NpuMetadataBuilder, lengths_as_tensors=graph)
    ops = {name: getattr(npu_ops, name) for name in NPU_OPS}
    ops.update({name: REFERENCE_OPS[name] for name in NPU_REFERENCE_OPS})
    linear = linear_methods(PLAIN, npu_linear_methods(torch_npu, PLAIN), "npu")
    name = "npu_graph" if graph else "npu"
    return Backend(name, linear=linear, metadata_builder=metadata_builder, attention=attention, **common, **ops)
