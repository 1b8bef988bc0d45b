"""Linear weights reordered once, at load, into oneDNN's blocked layout for the CPU.

MKL's sgemm repacks the weight on every call; at decode's few rows that repacking costs as much
as the multiply. oneDNN's linear over a weight reordered ahead of time skips it: measured on an AVX2
EPYC at 32 rows, 1.3-2x faster per projection and 2.2x for SmolLM2's LM head (docs/benchmarks.md).
The plain weight stays beside the blocked copy (double the memory of the linear weights), because
torch.compile traces plain F.linear (inductor packs for itself with freezing), a tied embedding
reads it, and so do state_dict and the weight loaders. `model_config.prepack_weights` turns it off.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# The row count oneDNN chooses its blocking for: a decode batch. Any row count runs correctly.
DECODE_ROWS_HINT = 32


def reorder_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's blocked layout, or None where oneDNN cannot take it (bf16
    needs AVX-512 or AVX-NE-CONVERT; torch built without oneDNN)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), DECODE_ROWS_HINT)
    except RuntimeError as exc:
        logger.info("linear weights stay in MKL's plain layout: %s", str(exc).splitlines()[0])
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b, through the blocked copy where there is one (never inside torch.compile, which
    traces the plain weight)."""
    if blocked is None or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")


class BlockedWeightMixin:
    """A layer whose `weight` [out, in] a blocked copy can serve; `blocked_weight` is a plain
    attribute, not a buffer, so it is in no state_dict."""

    weight: nn.Parameter
    blocked_weight: torch.Tensor | None = None

    def reorder_weight(self) -> bool:
        """Make (or remake, after the weights change) the blocked copy; whether there is one."""
        self.blocked_weight = reorder_for_cpu(self.weight)
        return self.blocked_weight is not None


def reorder_linear_weights(model: nn.Module) -> int:
    """Blocked copies for every layer of `model` that takes one; how many got one."""
    layers = [module for module in model.modules() if isinstance(module, BlockedWeightMixin)]
    count = 0
    for layer in layers:
        if not layer.reorder_weight():
            break  # the same dtype and device throughout: if one cannot, none can
        count += 1
    return count
