"""How a linear layer multiplies: one LinearMethod per weight scheme, as vLLM's quantization methods.

A layer holds the method its backend gave it for its scheme; the worker calls `process_weights`
once after loading (to lay weights out for a kernel, or to quantize them), and the forward calls
`apply`. The unquantized methods are here and in ops/cpu.py (the CPU's packed layouts); the quantized
schemes' (W8A8, WNA16, FP8, ...) are ops/quantized_linear.py's, ops/cpu_quantized.py's, ops/cuda_quant.py's
and ops/npu_quant.py's, one per scheme and device (ops/backend.py's linear_methods).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

UNQUANTIZED = "unquantized"


def set_layer_attr(layer: nn.Module, name: str, value: object) -> None:
    """Keep `value` (a layout, a flag, None) as `layer`'s attribute `name`, through nn.Module's
    setattr as `layer.name = value` would: torch types a module's attributes as tensors and modules."""
    setattr(layer, name, value)


class LinearMethod:
    """x W^T + b for a layer whose `weight` is [out, in]."""

    def process_weights(self, layer: nn.Module) -> None:
        """Called once after the weights are loaded (and again whenever they change)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def describe(self, layer: nn.Module) -> str:
        """How this method runs `layer` (after process_weights), for the start-up log."""
        return type(self).__name__

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x as the scheme's activation quantization leaves it (for an op that multiplies the layer's
        weight itself: MLA's absorbed kv_b_proj); unchanged for unquantized inputs."""
        return x


class PlainLinear(LinearMethod):
    """F.linear over the plain weight: every device's unquantized form, and the CPU's without packing."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)


PLAIN = PlainLinear()  # stateless: one instance serves every layer and every record


def process_linear_weights(model: nn.Module) -> list[str]:
    """Run every layer's LinearMethod.process_weights once (after loading), and every quantized routed
    experts layer's ExpertsMethod (ops/quantized_experts.py); the methods' names, for the log."""
    names = []
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, LinearMethod):
            method.process_weights(module)
            names.append(type(method).__name__)
        experts_method = getattr(module, "experts_method", None)
        if experts_method is not None:
            experts_method.process_weights(module)
            names.append(type(experts_method).__name__)
    return sorted(set(names))
