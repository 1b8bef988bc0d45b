"""Linear methods for quantized weights (ops/linear_method.py's interface), one per scheme kind.

A quantized layer (module/quantized.py) holds its checkpoint's tensors, decoded: `weight` (int8
values, float8 values, fp4 values as floats, or uint8 codes beside a float offset), `weight_scale`,
optionally `weight_zero_point` or `weight_offset` and a static `input_scale`, and its `scheme`
(executor/types_/quant_scheme.py). A layer quantized at load (`model_config.quantization`) holds its
float `weight` and `quantize_at_load` instead; process_weights rounds it to nearest first. Each
method then keeps what its kernel reads as the layer's non-persistent buffers (`keep_tensors`): the
graph modes take a module's buffers as its weights (npugraph_ex's AOTInductor packages bind them by
name at load), where tensors in a plain attribute would be baked into the graph as unnamed constants.

- Int8ScaledLinear (W8A8 int8): activations quantized per token (or by the static scale), an int8 x
  int8 -> int32 matmul (`torch._int_mm`: oneDNN with VNNI on the CPU), the scales applied after.
- DequantizedLinear: the weight dequantized once at load into the model's dtype and multiplied by
  the backend's unquantized method, the activations fake-quantized where the scheme quantizes them:
  the scheme computed plainly, for kinds a backend has no kernel for (said in the start-up log).
- NativeLinear: the base of a device kernel that runs some schemes of its kind (fp8 per row but not
  per block, int4 groups of 32k); the layers it refuses are dequantized at load, with the reason.

Everything here traces into one graph (torch.compile, fullgraph): Python branches read only what
process_weights fixed, and the CPU's int8 matmul is an opaque op (ops/cpu.py's int8_mm).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from executor.types_.quant_scheme import LinearScheme
from ops import quant_math
from ops.linear_method import LinearMethod, set_layer_attr

logger = logging.getLogger(__name__)

IntMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Rescale = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A layer's quantized weight, decoded: values [N, K], scale and zero point (or float offset) in
    the scheme's shape."""

    values: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    input_scale: torch.Tensor | None
    offset: torch.Tensor | None = None


def layer_scheme(layer: nn.Module) -> LinearScheme:
    """The scheme set_scheme gave a quantized layer (module/quantized.py, module/moe.py)."""
    return cast(LinearScheme, layer.scheme)


def quantized_weight(layer: nn.Module) -> QuantizedWeight:
    """The layer's weight as its scheme holds it: its own tensors, or its float weight rounded to
    nearest, which then replace the float one (so it is not held twice; a tied LM head unties)."""
    scheme = layer_scheme(layer)
    if getattr(layer, "quantize_at_load", False):
        weight = cast(torch.Tensor, layer.weight)
        values, scale, zero_point = quant_math.quantize_weight(weight.detach(), scheme.weights)
        layer.weight = nn.Parameter(values, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if zero_point is not None:
            layer.weight_zero_point = nn.Parameter(zero_point, requires_grad=False)
        set_layer_attr(layer, "quantize_at_load", False)
    zero_point = getattr(layer, "weight_zero_point", None)
    input_scale = getattr(layer, "input_scale", None)
    offset = getattr(layer, "weight_offset", None)
    return QuantizedWeight(
        cast(torch.Tensor, layer.weight).detach(),
        cast(torch.Tensor, layer.weight_scale).detach(),
        None if zero_point is None else zero_point.detach(),
        None if input_scale is None else input_scale.detach().float(),
        None if offset is None else offset.detach(),
    )


def keep_tensors(layer: nn.Module, **tensors: torch.Tensor | None) -> None:
    """Hold a kernel's tensors as non-persistent buffers of `layer` (None: registered as absent)."""
    for name, tensor in tensors.items():
        if name in layer._buffers:
            layer._buffers[name] = tensor
        else:
            layer.register_buffer(name, tensor, persistent=False)


class Int8ScaledLinear(LinearMethod):
    """W8A8 int8: y = (q(x) @ W_q^T) * s_x * s_w + b with the product accumulated in int32.

    `int_mm` is the device's int8 matmul ([M, K] x [K, N] -> int32), named by `kernel` in the log:
    torch._int_mm behind an opaque op on the CPU (ops/cpu.py), a padded form of it on CUDA
    (ops/cuda_quant.py). `quantize` (per-token dynamic quantization) and `rescale` (int32 -> fp32
    with both scales and the bias) are the plain-torch ones unless the backend has kernels that give
    the same values in one pass (ops/cpu_quantized.py)."""

    def __init__(
        self,
        int_mm: IntMatmul = torch._int_mm,
        kernel: str = "torch._int_mm",
        quantize: Quantize = quant_math.quantize_int8_per_token,
        rescale: Rescale = quant_math.int8_rescale,
    ) -> None:
        self.int_mm = int_mm
        self.kernel = kernel
        self.quantize = quantize
        self.rescale = rescale

    def describe(self, layer: nn.Module) -> str:
        return f"native int8 matmul ({self.kernel})"

    def process_weights(self, layer: nn.Module) -> None:
        """The int8 weight as matmul takes it (here W^T [K, N] contiguous), fp32 scales [1, N], the
        static input scale (or None)."""
        weight = quantized_weight(layer)
        out_features = weight.values.shape[0]
        keep_tensors(
            layer,
            int8_matmul_weight=self.pack(weight.values.to(torch.int8)),
            int8_weight_scale=weight.scale.float().reshape(1, -1).expand(1, out_features).contiguous(),
            int8_input_scale=weight.input_scale,
        )

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """The int8 weight [N, K] laid out for matmul: transposed for int_mm."""
        return values.t().contiguous()

    def matmul(self, layer: nn.Module, x_values: torch.Tensor, out_features: int) -> torch.Tensor:
        """int8 rows [M, K] times the layer's int8 weight: int32 [M, N]."""
        return self.int_mm(x_values, cast(torch.Tensor, layer.int8_matmul_weight))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = cast("torch.Tensor | None", layer.int8_input_scale)
        weight_scale = cast(torch.Tensor, layer.int8_weight_scale)
        out_features = weight_scale.shape[1]
        rows = x.reshape(-1, x.shape[-1])
        if input_scale is None:
            x_values, x_scale = self.quantize(rows)
        else:
            x_scale = input_scale.reshape(1, 1)
            x_values = quant_math.quantize_int8(rows, x_scale)
        out = self.rescale(self.matmul(layer, x_values, out_features), x_scale, weight_scale, bias)
        return out.to(x.dtype).view(*x.shape[:-1], out_features)


class DequantizedLinear(LinearMethod):
    """The scheme computed plainly: W dequantized once into the model's dtype, multiplied by `dense`
    (the backend's unquantized method, which may pack it), inputs fake-quantized where the scheme
    says. `reason` says why the backend runs the kind so ("no native fp8 matmul on cpu")."""

    def __init__(self, dense: LinearMethod, reason: str = "no native kernel") -> None:
        self.dense = dense
        self.reason = reason

    def describe(self, layer: nn.Module) -> str:
        return f"dequantized once at load: {self.reason}"

    def process_weights(self, layer: nn.Module) -> None:
        weight = quantized_weight(layer)
        args = layer_scheme(layer).weights
        compute_dtype = cast(torch.dtype, layer.compute_dtype)
        dense = quant_math.dequantize_weight(
            weight.values, weight.scale, weight.zero_point, args, compute_dtype, weight.offset
        )
        layer.weight = nn.Parameter(dense, requires_grad=False)
        keep_tensors(layer, fake_input_scale=weight.input_scale)
        self.dense.process_weights(layer)

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inputs = layer_scheme(layer).input_activations
        if inputs is None:
            return x
        return quant_math.fake_quantize_activation(x, inputs, cast("torch.Tensor | None", layer.fake_input_scale))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.dense.apply(layer, self.quantize_input(layer, x), bias)


class NativeLinear(LinearMethod):
    """A device kernel for the schemes of its kind that `refusal` lets through; a layer it refuses
    (a reason, decided once at process_weights) runs dequantized by `fallback` instead."""

    kernel = "a native kernel"

    def __init__(self, fallback: DequantizedLinear) -> None:
        self.fallback = fallback

    def refusal(self, layer: nn.Module) -> str | None:
        """Why the kernel cannot run this layer's scheme, None when it can."""
        return None

    def pack(self, layer: nn.Module) -> None:
        """Lay the layer's quantized weight out for the kernel (process_weights of a layer it runs)."""
        raise NotImplementedError

    def run(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights(self, layer: nn.Module) -> None:
        set_layer_attr(layer, "native_refusal", self.refusal(layer))
        if layer.native_refusal is None:
            self.pack(layer)
        else:
            self.fallback.process_weights(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.native_refusal is None:
            return self.run(layer, x, bias)
        return self.fallback.apply(layer, x, bias)

    def describe(self, layer: nn.Module) -> str:
        if layer.native_refusal is None:
            return f"native ({self.kernel})"
        return f"dequantized once at load: {layer.native_refusal}"
