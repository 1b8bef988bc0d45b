"""The CPU's unquantized LinearMethod: linear weights laid out once, at load, for the CPU's fastest
kernel at decode's few rows.

MKL's sgemm repacks the weight on every call; at a decode step's 32 rows that repacking costs as
much as the multiply. So each linear layer and the LM head keep a second copy of their weight:
- on a CPU with AVX2 and FMA but no AVX-512, in 24-column panels for ops/csrc/packed_linear.cpp,
  which streams each panel once per four rows (1.3x oneDNN's blocked kernel per decode step's
  linears and 2x at one row, on a Zen 3 EPYC; docs/benchmarks.md). Past `PANEL_ROWS_MAX` rows (a
  prefill) MKL's own blocking wins and the plain weight serves;
- on a CPU with AVX-512, in oneDNN's blocked layout (its kernels use the wider vectors there);
- elsewhere (bf16 that oneDNN cannot reorder, no oneDNN) not at all.
Which layout is decided once, when the backend is made (ops/backend.py). The plain weight stays,
because torch.compile traces plain F.linear (inductor packs for itself with freezing), a tied
embedding reads it, and so do state_dict and the weight loaders. `model_config.prepack_weights`
turns the copies off (the backend then gives layers PlainLinear).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ops import cpu_kernels
from ops.linear_method import LinearMethod

logger = logging.getLogger(__name__)

# Rows up to which the panel kernel beats MKL on the plain weight (measured: 1.3x at 256 rows, even
# at about 1,000; at 4,800 MKL ran 158.6 GFLOP/s against the panels' 139.4).
PANEL_ROWS_MAX = 1024
# The row count oneDNN chooses its blocking for: a decode batch. Any row count runs correctly.
DECODE_ROWS_HINT = 32


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [out, in] weight laid out for one CPU kernel: "panels" (packed_linear.cpp) or "onednn"."""

    data: torch.Tensor
    out_features: int
    layout: str


class PanelLinear(LinearMethod):
    """AVX2 panels (ops/csrc/packed_linear.cpp) for fp32 up to PANEL_ROWS_MAX rows, MKL past them."""

    layout = "panels"

    def __init__(self, pack: Callable[..., torch.Tensor], multiply: Callable[..., torch.Tensor]) -> None:
        self.pack = pack
        self.multiply = multiply

    def process_weights(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        layer.packed_weight = PackedWeight(self.pack(weight), weight.shape[0], self.layout)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.packed_weight
        rows = x.numel() // x.shape[-1]
        if packed is None or rows > PANEL_ROWS_MAX or torch.compiler.is_compiling():
            return F.linear(x, layer.weight, bias)
        out = cpu_kernels.named("packed_linear", self.multiply)(
            x.reshape(rows, x.shape[-1]), packed.data, bias, packed.out_features
        )
        return out.view(*x.shape[:-1], packed.out_features)


class OneDnnLinear(LinearMethod):
    """oneDNN's blocked layout (AVX-512 CPUs); the plain weight where oneDNN cannot reorder it (bf16
    without AVX-512 BF16), or inside torch.compile."""

    layout = "onednn"

    def process_weights(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        try:
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_ROWS_HINT)
        except RuntimeError as exc:  # bf16 needs AVX-512 or AVX-NE-CONVERT
            logger.info("linear weights stay in MKL's plain layout: %s", str(exc).splitlines()[0])
            layer.packed_weight = None
            return
        layer.packed_weight = PackedWeight(blocked, weight.shape[0], self.layout)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.packed_weight
        if packed is None or torch.compiler.is_compiling():
            return F.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")


def cpu_linear_method(dtype: torch.dtype, extension: object | None, flags: frozenset[str]) -> LinearMethod | None:
    """The packed method for weights of `dtype` on a CPU with `flags` and the built `extension` (or
    None), or None where only the plain layout serves."""
    panels = {"avx2", "fma"} <= flags and "avx512f" not in flags
    if dtype == torch.float32 and extension is not None and panels:
        return PanelLinear(extension.pack_linear_weight, extension.packed_linear)
    if torch.backends.mkldnn.is_available():
        return OneDnnLinear()
    return None
