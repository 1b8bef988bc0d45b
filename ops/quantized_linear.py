"""Linear methods for quantized weights (ops/linear_method.py's interface), one per scheme kind.

A quantized layer (module/quantized.py) holds its checkpoint's tensors, decoded: `weight` (int8
values, float8 values, or fp4 values as floats), `weight_scale`, optionally `weight_zero_point` and a
static `input_scale`, and its `scheme` (executor/types_/quant_scheme.py). A layer quantized at load
(`model_config.quantization`) holds its float `weight` and `quantize_at_load` instead;
process_weights rounds it to nearest first. Each method then lays out what its kernel reads in
`layer.packed_weight`, as the unquantized methods do.

- Int8ScaledLinear (W8A8 int8): activations quantized per token (or by the static scale), an int8 x
  int8 -> int32 matmul (`torch._int_mm`: oneDNN with VNNI on the CPU), the scales applied after.
- DequantizedLinear: the weight dequantized once at load into the model's dtype and multiplied by
  the backend's unquantized method, the activations fake-quantized where the scheme quantizes them:
  the scheme computed plainly, for kinds a backend has no kernel for (said in the start-up log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.quant_scheme import LinearScheme, QuantArgs
from ops import quant_math
from ops.linear_method import LinearMethod

logger = logging.getLogger(__name__)

IntMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Rescale = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A layer's quantized weight, decoded: values [N, K], scale and zero point in the scheme's shape."""

    values: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    input_scale: torch.Tensor | None


def quantized_weight(layer: nn.Module) -> QuantizedWeight:
    """The layer's weight as its scheme holds it: its own tensors, or its float weight rounded to nearest."""
    scheme: LinearScheme = layer.scheme
    if getattr(layer, "quantize_at_load", False):
        values, scale, zero_point = quant_math.quantize_weight(layer.weight.detach(), scheme.weights)
        return QuantizedWeight(values, scale, zero_point, None)
    zero_point = getattr(layer, "weight_zero_point", None)
    input_scale = getattr(layer, "input_scale", None)
    return QuantizedWeight(
        layer.weight.detach(),
        layer.weight_scale.detach(),
        None if zero_point is None else zero_point.detach(),
        None if input_scale is None else input_scale.detach().float(),
    )


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """What Int8ScaledLinear multiplies: int8 W^T [K, N] contiguous, fp32 scales [1, N], a static input scale."""

    transposed: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None
    out_features: int


class Int8ScaledLinear(LinearMethod):
    """W8A8 int8: y = (q(x) @ W_q^T) * s_x * s_w + b with the product accumulated in int32.

    `int_mm` is the device's int8 matmul ([M, K] x [K, N] -> int32): torch._int_mm on the CPU, a
    padded form of it on CUDA (ops/cuda_quant.py). `quantize` (per-token dynamic quantization) and
    `rescale` (int32 -> fp32 with both scales and the bias) are the plain-torch ones unless the
    backend has kernels that give the same values in one pass (ops/cpu_quantized.py)."""

    def __init__(
        self,
        int_mm: IntMatmul = torch._int_mm,
        quantize: Quantize = quant_math.quantize_int8_per_token,
        rescale: Rescale = quant_math.int8_rescale,
    ) -> None:
        self.int_mm = int_mm
        self.quantize = quantize
        self.rescale = rescale

    def process_weights(self, layer: nn.Module) -> None:
        weight = quantized_weight(layer)
        scale = weight.scale.float().reshape(-1)
        out_features = weight.values.shape[0]
        if scale.numel() == 1:
            scale = scale.expand(out_features)
        layer.packed_weight = Int8Weight(
            weight.values.to(torch.int8).t().contiguous(),
            scale.reshape(1, -1).contiguous(),
            weight.input_scale,
            out_features,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed: Int8Weight = layer.packed_weight
        rows = x.reshape(-1, x.shape[-1])
        if packed.input_scale is None:
            x_values, x_scale = self.quantize(rows)
        else:
            x_scale = packed.input_scale.reshape(1, 1)
            x_values = torch.clamp(torch.round(rows.float() / x_scale), -128, 127).to(torch.int8)
        out = self.rescale(self.int_mm(x_values, packed.transposed), x_scale, packed.scale, bias)
        return out.to(x.dtype).view(*x.shape[:-1], packed.out_features)


class DequantizedLinear(LinearMethod):
    """The scheme computed plainly: W dequantized once into the model's dtype, multiplied by `dense`
    (the backend's unquantized method, which may pack it), inputs fake-quantized where the scheme says."""

    def __init__(self, dense: LinearMethod) -> None:
        self.dense = dense

    def process_weights(self, layer: nn.Module) -> None:
        weight = quantized_weight(layer)
        args = layer.scheme.weights
        dense = quant_math.dequantize_weight(weight.values, weight.scale, weight.zero_point, args, layer.compute_dtype)
        layer.weight = nn.Parameter(dense, requires_grad=False)
        layer.input_scale_value = weight.input_scale
        self.dense.process_weights(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        inputs: QuantArgs | None = layer.scheme.input_activations
        if inputs is not None:
            x = quant_math.fake_quantize_activation(x, inputs, layer.input_scale_value)
        return self.dense.apply(layer, x, bias)
