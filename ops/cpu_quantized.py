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

from executor.types_.quant_scheme import GGUF_BLOCK_SCHEMES
from ops import quant_math
from ops.cpu import named
from ops.linear_method import LinearMethod, set_layer_attr
from ops.quantized_linear import DequantizedLinear, Int8ScaledLinear, keep_tensors, layer_scheme, quantized_weight

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


class Int16MaddInt8Linear(Int8ScaledLinear):
    """W8A8 on CPUs with AVX2 but no AVX-512 VNNI, where oneDNN runs torch._int_mm's signed int8
    product by a reference loop (30-80x slower than fp32 on Zen 2): the int8 weight widened to int16
    panels once at load and multiplied by int16_madd_mm.cpp (vpmaddwd, exact int32 sums), between
    int8_quant.cpp's one-pass quantization and rescale."""

    def __init__(self, kernels: Any) -> None:
        int8 = CpuInt8Kernels(kernels)
        super().__init__(
            kernel="int16_madd_mm.cpp, AVX2, weights packed at load", quantize=int8.quantize, rescale=int8.rescale
        )
        self.kernels = kernels

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """int16 panels of 8 columns (int16_madd_mm.cpp's layout)."""
        return self.kernels.pack_int16_madd_weight(values)

    def matmul(self, layer: nn.Module, x_values: torch.Tensor, out_features: int) -> torch.Tensor:
        # one opaque op in a compiled graph too (its fake: ops/cpu.py)
        return named("int16_madd_mm", self.kernels.int16_madd_mm)(x_values, layer.int8_matmul_weight, out_features)


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


# model_config.wna16_activations: how the few-row kernel multiplies (docs/quantization.md).
FLOAT_ACTIVATIONS, INT8_ACTIVATIONS, AUTO_ACTIVATIONS = "float", "int8", "auto"
WNA16_ACTIVATIONS = (AUTO_ACTIVATIONS, FLOAT_ACTIVATIONS, INT8_ACTIVATIONS)
Q8_BLOCK = 32  # q8_dot_linear.cpp's activation block: its weight groups are whole blocks
Q8_PANEL_COLUMNS = 8  # q8_dot_linear.cpp's panel width


@dataclass(frozen=True, slots=True)
class CodedWeight:
    """A coded weight as one of two kernels lays it out, w = u * scale + offset per group along K:
    wna16_linear.cpp's (`int8_rows` False: unsigned codes in 16-column panels, fp32 activations) or
    q8_dot_linear.cpp's (`int8_rows` True: 8-column panels, 8-bit codes signed, the activation rows
    quantized to int8 per 32 values, scales in fp16 where exact, zero offsets left out as an empty
    tensor); scales and offsets [panels, K / group, panel width]."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    out_features: int
    int8_rows: bool

    @property
    def dequantize_name(self) -> str:
        """Its dequantize op in the extension."""
        return "q8_dot_dequantize" if self.int8_rows else "wna16_dequantize"


def unsigned_codes(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """The layer's WNA16 weight as unsigned codes [N, K], fp32 scales and offsets [N, K / group] and the
    bits (symmetric: offset = -2^(b-1) s, exact; zero points: -(zp + 2^(b-1)) s), or None where no
    kernel takes it (not fp32, not 4/8 bits, odd groups)."""
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
        return weight.values.to(torch.uint8), scale, weight.offset.float().reshape(rows, groups), args.num_bits
    half = 2 ** (args.num_bits - 1)
    zero = 0.0 if weight.zero_point is None else weight.zero_point.float().reshape(rows, groups)
    offset = (-(zero + half) * scale).contiguous()
    return (weight.values.to(torch.int16) + half).to(torch.uint8), scale, offset, args.num_bits


def coded_weight(kernels: Any, layer: nn.Module, int8_rows: bool) -> CodedWeight | None:
    """The layer's WNA16 weight packed for q8_dot_linear.cpp where `int8_rows` and its groups are whole
    blocks of 32, for wna16_linear.cpp otherwise; None where neither takes it."""
    coded = unsigned_codes(layer)
    if coded is None:
        return None
    codes, scale, offset, bits = coded
    int8_rows = int8_rows and (codes.shape[1] // scale.shape[1]) % Q8_BLOCK == 0
    pack = kernels.pack_q8_dot_weight if int8_rows else kernels.pack_wna16_weight
    packed, scales, offsets = pack(codes, scale, offset, bits)
    return CodedWeight(packed, scales, offsets, bits, codes.shape[0], int8_rows)


def dequantize_coded(weight: CodedWeight) -> torch.Tensor:
    """The dense fp32 [N, K] weight of a coded one, in torch ops (what a compiled graph traces): the
    values the kernels' dequantize ops give by one fused multiply-add each, as u * s + o is exact in
    float64."""
    panels, width = weight.codes.shape
    if weight.int8_rows:
        columns = Q8_PANEL_COLUMNS
        if weight.bits == 4:  # [panels, block, chunk, column, 4]: low nibbles 8 * chunk + t, high ones + 4
            quads = weight.codes.view(panels, -1, 4, columns, 1, 4)
            codes = torch.cat([quads & 0xF, quads >> 4], dim=4).permute(0, 3, 1, 2, 4, 5)
        else:  # [panels, block, chunk, column, 4]: value 4 * chunk + t, signed
            codes = weight.codes.view(torch.int8).view(panels, -1, 8, columns, 4).permute(0, 3, 1, 2, 4)
        codes = codes.reshape(panels, columns, -1).transpose(1, 2)  # [panels, K, 8]
    else:
        columns = PANEL_COLUMNS
        if weight.bits == 4:
            pairs = weight.codes.view(panels, width // columns, 1, columns)
            codes = torch.cat([pairs & 0xF, pairs >> 4], dim=2).flatten(1, 2)
        else:
            codes = weight.codes.view(panels, width // columns, columns)
    group = codes.shape[1] // weight.scales.shape[1]
    scales = weight.scales.double().repeat_interleave(group, dim=1)
    dense = codes.double() * scales
    if weight.offsets.numel():  # q8_dot_linear.cpp leaves zero offsets out
        dense = dense + weight.offsets.double().repeat_interleave(group, dim=1)
    dense = dense.float()  # [panels, K, columns]
    return dense.permute(0, 2, 1).reshape(panels * columns, -1)[: weight.out_features]


class Wna16Linear(LinearMethod):
    """WNA16 (int4/int8 weights, fp32 activations) by a few-row kernel up to WNA16_ROWS_MAX rows, the
    weight dequantized per call and multiplied by F.linear past them; a layer no kernel takes (bf16
    models, odd groups) runs the scheme plainly (`plainly`: weights dequantized at load). The few-row
    kernel is wna16_linear.cpp (each weight dequantized to fp32: the exact path) or, as `activations`
    says per scheme, q8_dot_linear.cpp (the row quantized to int8 per 32 values and multiplied in
    integers, as llama.cpp does: faster, with the row's rounding); auto takes the latter for a GGUF's
    block schemes, whose users compare them with llama.cpp's, and the exact path for the rest."""

    def __init__(self, kernels: Any, plainly: DequantizedLinear, activations: str = AUTO_ACTIVATIONS) -> None:
        if activations not in WNA16_ACTIVATIONS:
            raise ValueError(f"wna16_activations must be one of {list(WNA16_ACTIVATIONS)}, got {activations!r}")
        self.kernels = kernels
        self.plainly = plainly
        self.activations = activations
        # the few-row kernels by whether the rows are int8 (resolved once: an op lookup per call adds up)
        self.row_kernels = {False: kernels.wna16_linear, True: kernels.q8_dot_linear}

    def int8_rows(self, layer: nn.Module) -> bool:
        """Whether `layer`'s few rows are quantized to int8 (the setting, or auto's rule by its scheme)."""
        if self.activations == AUTO_ACTIVATIONS:
            return layer_scheme(layer) in GGUF_BLOCK_SCHEMES.values()
        return self.activations == INT8_ACTIVATIONS

    def describe(self, layer: nn.Module) -> str:
        coded = self.coded(layer)
        if coded is None:
            return self.plainly.describe(layer)
        if coded.int8_rows:
            return (
                f"native {coded.bits}-bit weights times int8 rows per 32 values "
                f"(q8_dot_linear.cpp up to {WNA16_ROWS_MAX} rows)"
            )
        return f"native {coded.bits}-bit weights (wna16_linear.cpp up to {WNA16_ROWS_MAX} rows)"

    def process_weights(self, layer: nn.Module) -> None:
        """The coded weight's tensors as the layer's buffers (what graph modes bind as its weights)."""
        coded = coded_weight(self.kernels, layer, self.int8_rows(layer))
        set_layer_attr(layer, "wna16_bits", None if coded is None else coded.bits)
        if coded is None:
            self.plainly.process_weights(layer)
            return
        set_layer_attr(layer, "wna16_out_features", coded.out_features)
        set_layer_attr(layer, "wna16_int8_rows", coded.int8_rows)
        keep_tensors(layer, wna16_codes=coded.codes, wna16_scales=coded.scales, wna16_offsets=coded.offsets)

    @staticmethod
    def coded(layer: nn.Module) -> CodedWeight | None:
        """The layer's coded weight as process_weights kept it, or None where it runs plainly."""
        if layer.wna16_bits is None:
            return None
        return CodedWeight(
            cast(torch.Tensor, layer.wna16_codes),
            cast(torch.Tensor, layer.wna16_scales),
            cast(torch.Tensor, layer.wna16_offsets),
            cast(int, layer.wna16_bits),
            cast(int, layer.wna16_out_features),
            cast(bool, layer.wna16_int8_rows),
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.wna16_bits is None:
            return self.plainly.apply(layer, x, bias)
        rows = x.numel() // x.shape[-1]
        int8_rows = cast(bool, layer.wna16_int8_rows)
        few_rows = rows <= WNA16_ROWS_MAX and x.dtype == torch.float32
        if few_rows and (int8_rows or not torch.compiler.is_compiling()):
            # the step's hot path at decode: the buffers read as they are (a CodedWeight costs more
            # than a small layer's kernel); the int8-row kernel is one opaque op in a compiled graph
            # too (its fake: ops/cpu.py), so a graph gives eager's values
            name = "q8_dot_linear" if int8_rows else "wna16_linear"
            out_features = cast(int, layer.wna16_out_features)
            out = named(name, self.row_kernels[int8_rows])(
                x if x.dim() == 2 else x.reshape(rows, x.shape[-1]),
                layer.wna16_codes,
                layer.wna16_scales,
                layer.wna16_offsets,
                bias,
                layer.wna16_bits,
                out_features,
            )
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
        coded = self.coded(layer)
        assert coded is not None
        if torch.compiler.is_compiling():
            return F.linear(x, dequantize_coded(coded), bias)
        dequantize = getattr(self.kernels, coded.dequantize_name)
        dense = dequantize(coded.codes, coded.scales, coded.offsets, coded.bits, coded.out_features)
        return F.linear(x, dense.to(x.dtype), bias)
