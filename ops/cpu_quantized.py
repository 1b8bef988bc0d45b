"""The CPU's quantized kernels as linear methods or their parts: W8A8's whole linear on CPUs with
AVX-512 VNNI (ops/csrc/int8_linear.cpp), its per-token quantization and rescale around
torch._int_mm elsewhere (ops/csrc/int8_quant.cpp), and the weight-only 4/8-bit linear for decode's
few rows (ops/csrc/wna16_linear.cpp), each behind its guard and falling back to the plain-torch form.

The int8 kernels give the reference's values exactly (ops/quant_math.py); the weight-only kernel
differs from F.linear over the dequantized weight only in the order of its fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ops import quant_math
from ops.cpu import named
from ops.linear_method import LinearMethod, set_layer_attr
from ops.quantized_linear import DequantizedLinear, keep_tensors, layer_scheme, quantized_weight

# Rows up to which the 4/8-bit kernel runs (decode at batch 1..8); past them the weight is
# dequantized for the call and the dense kernel multiplies it, as the kernel's repeated in-register
# dequantization loses to oneDNN's fp32 blocking there (0.7x at 16 rows on an AVX-512 EPYC; docs/benchmarks.md).
WNA16_ROWS_MAX = 8
PANEL_COLUMNS = 16  # wna16_linear.cpp's panel width


class CpuInt8Kernels:
    """quantize_int8_per_token and int8_rescale by int8_quant.cpp for fp32 rows, by quant_math otherwise."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if rows.dtype != torch.float32 or rows.dim() != 2 or torch.compiler.is_compiling():
            return quant_math.quantize_int8_per_token(rows)
        values, scale = named("quantize_int8_per_token", self.kernels.quantize_int8_per_token)(rows)
        return values, scale

    def rescale(
        self, accumulated: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return quant_math.int8_rescale(accumulated, x_scale, weight_scale, bias)
        return named("int8_rescale", self.kernels.int8_rescale)(accumulated, x_scale, weight_scale, bias)


# The CPU flags int8_linear.cpp needs (Linux's names).
VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


class VnniInt8Linear(LinearMethod):
    """W8A8 int8 for fp32 models on CPUs with AVX-512 VNNI: quantization, the int8 matmul over a
    weight packed once at load, and the rescale in one kernel (int8_linear.cpp), with no int32
    matrix between them; 1.1-2.5x the three passes around torch._int_mm (docs/benchmarks.md)."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def describe(self, layer: nn.Module) -> str:
        return "native int8 matmul (int8_linear.cpp, AVX-512 VNNI, weights packed at load)"

    def process_weights(self, layer: nn.Module) -> None:
        """The VPDPBUSD panels and their column compensation, fp32 scales [N], the static input scale."""
        weight = quantized_weight(layer)
        out_features = weight.values.shape[0]
        packed, compensation = self.kernels.pack_int8_weight(weight.values.to(torch.int8))
        keep_tensors(
            layer,
            int8_packed=packed,
            int8_compensation=compensation,
            int8_weight_scale=weight.scale.float().reshape(-1).expand(out_features).contiguous(),
            int8_input_scale=weight.input_scale,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out_features = cast(torch.Tensor, layer.int8_weight_scale).shape[0]
        rows = x.reshape(-1, x.shape[-1])
        # one opaque op in a compiled graph too (its fake: ops/cpu.py)
        out = named("int8_linear", self.kernels.int8_linear_forward)(
            rows,
            layer.int8_packed,
            layer.int8_compensation,
            layer.int8_weight_scale,
            layer.int8_input_scale,
            bias,
            out_features,
        )
        return out.view(*x.shape[:-1], out_features)


@dataclass(frozen=True, slots=True)
class CodedWeight:
    """wna16_linear.cpp's layout: unsigned codes in 16-column panels, fp32 scales and offsets
    [panels, K / group, 16] with w = u * scale + offset."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    out_features: int


def coded_weight(kernels: Any, layer: nn.Module) -> CodedWeight | None:
    """The layer's WNA16 weight as unsigned codes, scales and offsets (symmetric: offset = -2^(b-1) s,
    exact; zero points: -(zp + 2^(b-1)) s), packed; None where the kernel does not take it."""
    args = layer_scheme(layer).weights
    weight = quantized_weight(layer)
    rows, cols = weight.values.shape
    groups = weight.scale.shape[-1] if weight.scale.dim() == 2 else 1
    if layer.compute_dtype != torch.float32 or args.num_bits not in (4, 8) or cols % groups:
        return None
    if (cols // groups) % 2:
        return None
    scale = weight.scale.float().reshape(rows, groups)
    if weight.offset is not None:  # unsigned codes with a float offset already (GGUF Q4_1)
        codes, offset = weight.values.to(torch.uint8), weight.offset.float().reshape(rows, groups)
    else:
        half = 2 ** (args.num_bits - 1)
        zero = 0.0 if weight.zero_point is None else weight.zero_point.float().reshape(rows, groups)
        offset = -(zero + half) * scale
        codes = (weight.values.to(torch.int16) + half).to(torch.uint8)
    packed, scales, offsets = kernels.pack_wna16_weight(codes, scale, offset.contiguous(), args.num_bits)
    return CodedWeight(packed, scales, offsets, args.num_bits, rows)


def dequantize_coded(weight: CodedWeight) -> torch.Tensor:
    """The dense fp32 [N, K] weight of a coded one, in torch ops (what a compiled graph traces): the
    values wna16_dequantize gives by one fused multiply-add each, as u * s + o is exact in float64."""
    panels, width = weight.codes.shape
    if weight.bits == 4:
        pairs = weight.codes.view(panels, width // PANEL_COLUMNS, 1, PANEL_COLUMNS)
        codes = torch.cat([pairs & 0xF, pairs >> 4], dim=2).flatten(1, 2)
    else:
        codes = weight.codes.view(panels, width // PANEL_COLUMNS, PANEL_COLUMNS)
    group = codes.shape[1] // weight.scales.shape[1]
    scales = weight.scales.repeat_interleave(group, dim=1)
    offsets = weight.offsets.repeat_interleave(group, dim=1)
    dense = (codes.double() * scales.double() + offsets.double()).float()  # [panels, K, 16]
    return dense.permute(0, 2, 1).reshape(panels * PANEL_COLUMNS, -1)[: weight.out_features]


class Wna16Linear(LinearMethod):
    """WNA16 (int4/int8 weights, fp32 activations) by wna16_linear.cpp up to WNA16_ROWS_MAX rows, the
    weight dequantized per call and multiplied by F.linear past them; a layer the kernel does not
    take (bf16 models, odd groups) runs the scheme plainly (`plainly`: weights dequantized at load)."""

    def __init__(self, kernels: Any, plainly: DequantizedLinear) -> None:
        self.kernels = kernels
        self.plainly = plainly

    def describe(self, layer: nn.Module) -> str:
        if layer.wna16_bits is None:
            return self.plainly.describe(layer)
        return f"native {layer.wna16_bits}-bit weights (wna16_linear.cpp up to {WNA16_ROWS_MAX} rows)"

    def process_weights(self, layer: nn.Module) -> None:
        """The coded weight's tensors as the layer's buffers (what graph modes bind as its weights)."""
        coded = coded_weight(self.kernels, layer)
        set_layer_attr(layer, "wna16_bits", None if coded is None else coded.bits)
        if coded is None:
            self.plainly.process_weights(layer)
            return
        set_layer_attr(layer, "wna16_out_features", coded.out_features)
        keep_tensors(layer, wna16_codes=coded.codes, wna16_scales=coded.scales, wna16_offsets=coded.offsets)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.wna16_bits is None:
            return self.plainly.apply(layer, x, bias)
        coded = CodedWeight(
            cast(torch.Tensor, layer.wna16_codes),
            cast(torch.Tensor, layer.wna16_scales),
            cast(torch.Tensor, layer.wna16_offsets),
            cast(int, layer.wna16_bits),
            cast(int, layer.wna16_out_features),
        )
        rows = x.numel() // x.shape[-1]
        if torch.compiler.is_compiling():
            return F.linear(x, dequantize_coded(coded), bias)
        if rows > WNA16_ROWS_MAX or x.dtype != torch.float32:
            dense = self.kernels.wna16_dequantize(
                coded.codes, coded.scales, coded.offsets, coded.bits, coded.out_features
            )
            return F.linear(x, dense.to(x.dtype), bias)
        kernel = named("wna16_linear", self.kernels.wna16_linear)
        out = kernel(
            x.reshape(rows, x.shape[-1]), coded.codes, coded.scales, coded.offsets, bias, coded.bits, coded.out_features
        )
        return out.view(*x.shape[:-1], coded.out_features)
