"""The CPU backend: each C++ kernel of ops/cpu_kernels.py behind its shape guard, falling back to the
reference (ops/torch_ref.py) where the guard fails, and the packed linear methods. Its attention is
ops/attention/cpu.py.

The backend takes these only where the extension built (and the fused elementwise ones only for
fp32 models), decided once in ops/backend.py; so the guards here are about shapes, and about
torch.compile, which fuses the reference's ops itself. The ops a compiled graph calls (W8A8's int8
linear) have their fake here, beside their wrapper.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ops import torch_ref
from ops.cpu_kernels import extension, fake
from ops.linear_method import LinearMethod, set_layer_attr

logger = logging.getLogger(__name__)


def named(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel`, recorded as infer_recipes::`name` while a profiler runs (a pybind call is no aten op); as
    it is while a graph is traced (the op is the graph's node)."""
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return functools.partial(_recorded, f"infer_recipes::{name}", kernel)
    return kernel


def _recorded(label: str, kernel: Callable[..., Any], *args: Any) -> Any:
    with torch.profiler.record_function(label):
        return kernel(*args)


@torch.library.custom_op("infer_recipes::cpu_int8_mm", mutates_args=())
def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm (oneDNN) as an op inductor does not look into: with frozen weights its pattern
    passes rewrite _int_mm and the scales into onednn.qlinear_pointwise, whose C++ GEMM template
    fails to lower at decode's few rows (torch 2.13), so a quantized model would not compile."""
    return torch._int_mm(a, b)


@int8_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.int32)


@fake("int8_linear_forward")
def _(x: torch.Tensor, packed: torch.Tensor, compensation: torch.Tensor, *args: object) -> torch.Tensor:
    """W8A8's whole linear by ops/csrc/int8_linear.cpp (AVX-512 VNNI), one opaque op in a compiled graph
    (ops/cpu_quantized.py's VnniInt8Linear): [rows, out_features]."""
    out_features = args[-1]
    assert isinstance(out_features, int)
    return x.new_empty(x.shape[0], out_features)


@fake("int16_madd_mm")
def _(a: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """W8A8's int8 matmul on AVX2 by ops/csrc/int16_madd_mm.cpp, one opaque op in a compiled graph
    (ops/cpu_quantized.py's Int16MaddInt8Linear): int32 [rows, out_features]."""
    return a.new_empty(a.shape[0], out_features, dtype=torch.int32)


@fake("q8_dot_linear")
def _(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
    out_features: int,
    form: int = -1,
) -> torch.Tensor:
    """A few-row WNA16 linear with int8 rows by ops/csrc/q8_dot_linear.cpp, one opaque op in a compiled
    graph (ops/cpu_quantized.py's Wna16Linear): [rows, out_features]."""
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("infer_recipes::cpu_moe_experts", mutates_args=())
def moe_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """torch_ref.moe_experts with each expert's SiLU-and-mul by the fused fp32 kernel (its input, a
    linear's output, is contiguous). An op of its own, as the reference's is: it reads the counts on
    the host. Registered only once the extension built (CpuOps, fp32 models)."""
    kernels = extension()
    assert kernels is not None, "registered only once the extension built"
    fused = named("fused_silu_and_mul", kernels.fused_silu_and_mul)
    return torch_ref.experts_with_activation(
        hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj, None, None, fused
    )


@moe_experts.register_fake
def _(hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj):
    return torch.empty_like(hidden_states)


class CpuOps:
    """The C++ kernels of one built extension, as ops with the reference's signatures."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def argmax_rows(self, scores: torch.Tensor) -> torch.Tensor:
        """In vectors (ops/csrc/argmax_rows.cpp): over a verify step's 32 x 49,152 bf16 logits on two
        AVX-512 cores 0.05 ms against max(dim=-1)'s 0.53."""
        if scores.dim() == 2 and scores.shape[1] > 0 and not torch.compiler.is_compiling():
            return named("argmax_rows", self.kernels.argmax_rows)(scores, True)
        return torch_ref.argmax_rows(scores)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_contiguous() and not torch.compiler.is_compiling():
            return named("fused_rms_norm", self.kernels.fused_rms_norm)(x, weight.contiguous(), eps)
        return torch_ref.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        contiguous = x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
        if contiguous and not torch.compiler.is_compiling():
            normed, new_residual = named("fused_add_rms_norm", self.kernels.fused_add_rms_norm)(
                x, residual, weight.contiguous(), eps
            )
            return normed, new_residual
        return torch_ref.add_rms_norm(x, residual, weight, eps)

    def apply_rotary(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key in place (torch_ref.apply_rotary allows it): use the returned tensors."""
        if (
            query.dim() == key.dim() == 3
            and query.stride(-1) == key.stride(-1) == cos.stride(-1) == 1
            and cos.stride() == sin.stride()
            and not torch.compiler.is_compiling()
        ):
            rotated_query, rotated_key = named("fused_apply_rotary", self.kernels.fused_apply_rotary)(
                query, key, cos, sin
            )
            return rotated_query, rotated_key
        return torch_ref.apply_rotary(query, key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and not torch.compiler.is_compiling():
            return named("fused_silu_and_mul", self.kernels.fused_silu_and_mul)(x)
        return torch_ref.silu_and_mul(x)

    def moe_experts(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
    ) -> torch.Tensor:
        return moe_experts(hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj)


# -- the unquantized linear methods: weights laid out once, at load, for decode's few rows --------
# MKL's sgemm repacks the weight on every call; at a decode step's 32 rows that repacking costs as
# much as the multiply. So each linear layer and the LM head keep a second copy of their fp32 weight
# in panels for ops/csrc/packed_linear.cpp, which streams each panel once per pass of a few rows:
# 32 columns wide on a CPU with AVX-512 (2 to 32 rows at 1.1-1.5x MKL's packed GEMM and 1.5x its
# plain one per step's weights, cold, on an AMX Xeon), 24 on one with AVX2 and FMA only (1.3x
# oneDNN's blocked kernel per decode step's linears and 2x at one row on a Zen 3 EPYC;
# docs/benchmarks.md). Past `PANEL_ROWS_MAX` rows (a prefill) MKL's own blocking wins and the plain
# weight serves. Inside a compiled graph the panels serve from 2 rows, where inductor would pick MKL's
# packed GEMM (speculative verify steps), which reads the weight at two thirds of the speed; at one row
# too on a CPU without AVX-512, where inductor's own micro-GEMM over the frozen weight made SmolLM2's
# decode step 1.54x slower than the panels (Zen 2; it is as fast as them with AVX-512, Xeon). bf16 weights take AMX
# tiles where the CPU has AMX bf16 (ops/csrc/amx_linear.cpp: a step's weights stream once for up to
# 32 rows, where oneDNN's AMX kernel slows by a fifth from 8 rows to 32), else oneDNN's blocked
# layout where oneDNN can reorder them; elsewhere none is kept. Which layout is
# decided once, when the backend is made (ops/backend.py). The plain weight stays, because a tied
# embedding reads it, and so do state_dict, the weight loaders and graphs at one row.
# `model_config.prepack_weights` turns the copies off (the backend then gives layers PlainLinear).

# Rows up to which the panel kernel beats MKL on the plain weight (measured: 1.3x at 256 rows, even
# at about 1,000; at 4,800 MKL ran 158.6 GFLOP/s against the panels' 139.4).
PANEL_ROWS_MAX = 1024
# The panel width for each kernel: AVX-512 when the CPU has it, else AVX2.
AVX512_PANEL_WIDTH = 32
AVX2_PANEL_WIDTH = 24
# Rows up to which the AMX kernel serves bf16; F.linear (oneDNN on the plain weight) past them. Measured
# on SmolLM2's three shapes (hot, 2 cores): the kernel 1.2-1.8x F.linear at 128 rows, even at 256
# (0.9-1.8x), and behind at 384 (the LM head 0.57x): it re-reads x once per panel, oneDNN blocks x.
AMX_ROWS_MAX = 256
# The CPU flags the AMX kernel needs: the tiles, their bf16 products, AVX-512 BF16 for the rounding.
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"})
# The row count oneDNN chooses its blocking for: a decode batch. Any row count runs correctly.
DECODE_ROWS_HINT = 32


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [out, in] weight laid out for one CPU kernel: "panels" (packed_linear.cpp), "amx"
    (amx_linear.cpp) or "onednn"."""

    data: torch.Tensor
    out_features: int
    layout: str


class KernelLinear(LinearMethod):
    """A weight laid out once for one of this project's registered linear ops (`op(x, packed, bias,
    out_features)`), which serves up to `rows_max` rows, F.linear past them; in a compiled graph from
    `graph_rows_min` rows, inductor's own GEMM below them."""

    def __init__(
        self, layout: str, pack: Callable[[torch.Tensor], torch.Tensor], op: Any, rows_max: int, graph_rows_min: int = 2
    ) -> None:
        self.layout = layout
        self.pack = pack
        self.op = op
        self.rows_max = rows_max
        self.graph_rows_min = graph_rows_min

    def process_weights(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight).detach()
        set_layer_attr(layer, "packed_weight", PackedWeight(self.pack(weight), weight.shape[0], self.layout))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = cast("PackedWeight | None", layer.packed_weight)
        rows = x.numel() // x.shape[-1]
        if packed is None or rows > self.rows_max or (torch.compiler.is_compiling() and not self.in_graph(rows)):
            return F.linear(x, cast(torch.Tensor, layer.weight), bias)
        out = self.op(x.reshape(rows, x.shape[-1]), packed.data, bias, packed.out_features)
        return out.view(*x.shape[:-1], packed.out_features)

    def in_graph(self, rows: int) -> bool:
        """Whether a graph being compiled calls the op at `rows`: from `graph_rows_min`, and not in an
        exported program (AOTInductor packages hold no weights, and a packed copy is no parameter it
        could bind)."""
        return rows >= self.graph_rows_min and not torch.compiler.is_exporting()


class PanelLinear(KernelLinear):
    """fp32 panels of `width` columns (ops/csrc/packed_linear.cpp) up to PANEL_ROWS_MAX rows, MKL past them."""

    def __init__(self, pack: Callable[[torch.Tensor, int], torch.Tensor], width: int, graph_rows_min: int) -> None:
        super().__init__(
            "panels",
            lambda weight: pack(weight, width),
            torch.ops.infer_recipes.packed_linear,
            PANEL_ROWS_MAX,
            graph_rows_min,
        )
        self.width = width


class AmxLinear(KernelLinear):
    """bf16 weights in AMX tiles (ops/csrc/amx_linear.cpp) up to AMX_ROWS_MAX rows, F.linear past them."""

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__("amx", pack, torch.ops.infer_recipes.amx_linear, AMX_ROWS_MAX)


class OneDnnLinear(LinearMethod):
    """oneDNN's blocked layout (bf16 weights, and fp32 where the panels are not built); the plain weight
    where oneDNN cannot reorder it (bf16 without AVX-512 BF16), or inside torch.compile."""

    layout = "onednn"

    def process_weights(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight).detach()
        try:
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_ROWS_HINT)
        except RuntimeError as exc:  # bf16 needs AVX-512 or AVX-NE-CONVERT
            logger.info("linear weights stay in MKL's plain layout: %s", str(exc).splitlines()[0])
            set_layer_attr(layer, "packed_weight", None)
            return
        set_layer_attr(layer, "packed_weight", PackedWeight(blocked, weight.shape[0], self.layout))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = cast("PackedWeight | None", layer.packed_weight)
        if packed is None or torch.compiler.is_compiling():
            return F.linear(x, cast(torch.Tensor, layer.weight), bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")


def cpu_linear_method(dtype: torch.dtype, extension: Any | None, flags: frozenset[str]) -> LinearMethod | None:
    """The packed method for weights of `dtype` on a CPU with `flags` and the built `extension` (or
    None), or None where only the plain layout serves."""
    if dtype == torch.float32 and extension is not None and {"avx2", "fma"} <= flags:
        if "avx512f" in flags:
            return PanelLinear(extension.pack_linear_weight, AVX512_PANEL_WIDTH, graph_rows_min=2)
        return PanelLinear(extension.pack_linear_weight, AVX2_PANEL_WIDTH, graph_rows_min=1)
    if dtype == torch.bfloat16 and extension is not None and AMX_FLAGS <= flags and extension.amx_available():
        return AmxLinear(extension.pack_amx_weight)
    if torch.backends.mkldnn.is_available():
        return OneDnnLinear()
    return None
