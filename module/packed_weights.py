"""Linear weights laid out once, at load, for the CPU's fastest kernel at decode's few rows.

MKL's sgemm repacks the weight on every call; at a decode step's 32 rows that repacking costs as
much as the multiply. So each linear layer and the LM head keep a second copy of their weight:
- on a CPU with AVX2 and FMA but no AVX-512, in 24-column panels for ops/csrc/packed_linear.cpp,
  which streams each panel once per four rows (1.3x oneDNN's blocked kernel per decode step's
  linears and 2x at one row, on a Zen 3 EPYC; docs/benchmarks.md). Past `PANEL_ROWS_MAX` rows (a
  prefill) MKL's own blocking wins and the plain weight serves;
- on a CPU with AVX-512, in oneDNN's blocked layout (its kernels use the wider vectors there);
- elsewhere (bf16 that oneDNN cannot reorder, no oneDNN, another device) not at all.
The plain weight stays, because torch.compile traces plain F.linear (inductor packs for itself
with freezing), a tied embedding reads it, and so do state_dict and the weight loaders.
`model_config.prepack_weights` turns the copies off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ops import cpu_kernels

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

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x W^T + b over this layout, or None where the plain weight serves these rows better."""
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        rows = x.numel() // x.shape[-1]
        if rows > PANEL_ROWS_MAX or x.dtype != torch.float32:
            return None
        _, packed_linear = cpu_kernels.packed_linear()
        out = packed_linear(x.reshape(rows, x.shape[-1]), self.data, bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


def _has_avx512() -> bool:
    return "avx512f" in cpu_kernels.cpu_flags()


def pack_for_cpu(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` [out, in] in the layout this CPU multiplies fastest, or None (plain F.linear)."""
    if weight.device.type != "cpu":
        return None
    weight = weight.detach()
    kernels = cpu_kernels.packed_linear()
    if weight.dtype == torch.float32 and kernels is not None and not _has_avx512():
        pack_linear_weight, _ = kernels
        return PackedWeight(pack_linear_weight(weight), weight.shape[0], "panels")
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_ROWS_HINT)
    except RuntimeError as exc:  # bf16 needs AVX-512 or AVX-NE-CONVERT
        logger.info("linear weights stay in MKL's plain layout: %s", str(exc).splitlines()[0])
        return None
    return PackedWeight(blocked, weight.shape[0], "onednn")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """x W^T + b, through the packed copy where there is one and it serves these rows (never
    inside torch.compile, which traces the plain weight)."""
    if packed is not None and not torch.compiler.is_compiling():
        out = packed.linear(x, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


class PackedWeightMixin:
    """A layer whose `weight` [out, in] a packed copy can serve; `packed_weight` is a plain
    attribute, not a buffer, so it is in no state_dict."""

    weight: nn.Parameter
    packed_weight: PackedWeight | None = None

    def pack_weight(self) -> bool:
        """Make (or remake, after the weights change) the packed copy; whether there is one."""
        self.packed_weight = pack_for_cpu(self.weight)
        return self.packed_weight is not None


def pack_linear_weights(model: nn.Module) -> str | None:
    """Packed copies for every layer of `model` that takes one; their layout, or None if none."""
    layers = [module for module in model.modules() if isinstance(module, PackedWeightMixin)]
    for layer in layers:
        if not layer.pack_weight():
            return None  # the same dtype and device throughout: if one cannot, none can
    return layers[0].packed_weight.layout if layers else None
