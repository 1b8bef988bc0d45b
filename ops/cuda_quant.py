"""CUDA forms of the quantized matmuls: plain torch calls that run on a GPU (and, for testing, on
the CPU, where torch 2.13 has both ops too).

- padded_int_mm: torch._int_mm on CUDA takes more than 16 rows and K, N multiples of 8; decode
  steps have fewer rows, so the rows are padded to 17 and the padding dropped after.
- Fp8ScaledLinear: torch._scaled_mm over float8 e4m3 weights and activations, with one scale per
  tensor (both operands) or per row (activations per token, weights per output channel). It takes
  K and N multiples of 16, so odd layers are zero-padded at load (the activations along K per call).
  128x128-block weights are dequantized at load: torch 2.13 documents blockwise recipes for
  F.scaled_mm (BlockWise1x128 x BlockWise128x128) but the harness pins torch 2.11 on GPUs, unchecked.
- cuda_linear_methods: the record's native kernels, decided once from the device's capability
  (fp8 tensor cores from 8.9, Ada and Hopper) and logged.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from executor.types_.quant_scheme import CHANNEL, FP8, TENSOR, TOKEN, W8A8_INT8
from ops import quant_math
from ops.linear_method import LinearMethod, set_layer_attr
from ops.quantized_linear import (
    DequantizedLinear,
    Int8ScaledLinear,
    NativeLinear,
    keep_tensors,
    layer_scheme,
    quantized_weight,
)

logger = logging.getLogger(__name__)

CUDA_INT_MM_MIN_ROWS = 17
SCALED_MM_ALIGN = 16  # torch._scaled_mm: K and N multiples of 16
FP8_MIN_CAPABILITY = (8, 9)


def padded_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(a [M, K] int8, b [K, N] int8) -> int32 [M, N] for any M."""
    rows = a.shape[0]
    if rows >= CUDA_INT_MM_MIN_ROWS:
        return torch._int_mm(a, b)
    return torch._int_mm(F.pad(a, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - rows)), b)[:rows]


def padded_size(size: int, multiple: int = SCALED_MM_ALIGN) -> int:
    return -(-size // multiple) * multiple


class Fp8ScaledLinear(NativeLinear):
    """FP8 W8A8: y = (q(x) @ W_q^T) * s_x * s_w by torch._scaled_mm, the activations quantized
    as compressed-tensors does (per token max|x| / 448, or the static per-tensor scale). Per-tensor
    scales on both sides multiply in a tensorwise call (output in the model's dtype); anything per
    row runs rowwise, both scales expanded to rows, output bf16 (what the rowwise kernel writes)."""

    kernel = "torch._scaled_mm"

    def refusal(self, layer: nn.Module) -> str | None:
        scheme = layer_scheme(layer)
        weights, inputs = scheme.weights, scheme.input_activations
        if weights.strategy not in (TENSOR, CHANNEL):
            return f"torch._scaled_mm is used with per-tensor or per-row scales here, not {weights.describe()}"
        if inputs is None:
            return "fp8 weights with unquantized activations: torch._scaled_mm multiplies fp8 by fp8"
        if inputs.strategy not in (TOKEN, TENSOR) or (inputs.strategy == TENSOR and inputs.dynamic):
            return f"torch._scaled_mm is used with per-token or static per-tensor activations, not {inputs.describe()}"
        return None

    def pack(self, layer: nn.Module) -> None:
        """fp8 W^T [K', N'] column-major (K, N zero-padded to 16), the weight scale as one value
        [1, 1] or per row [1, N'], the static input scale (or None)."""
        weight = quantized_weight(layer)
        out_features, in_features = weight.values.shape
        scale = weight.scale.float().reshape(-1)
        if bool((scale == scale[0]).all()):
            scale = scale[:1].reshape(1, 1)
        else:
            scale = F.pad(scale, (0, padded_size(out_features) - out_features), value=1.0).reshape(1, -1)
        values = weight.values.to(torch.float8_e4m3fn).view(torch.uint8)  # padded as bytes: fp8 has no pad kernel
        values = F.pad(values, (0, padded_size(in_features) - in_features, 0, padded_size(out_features) - out_features))
        keep_tensors(
            layer,
            fp8_weight_t=values.view(torch.float8_e4m3fn).contiguous().t(),
            fp8_weight_scale=scale.contiguous(),
            fp8_input_scale=weight.input_scale,
        )
        set_layer_attr(layer, "fp8_features", (in_features, out_features))

    def run(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        in_features, out_features = cast("tuple[int, int]", layer.fp8_features)
        weight_t = cast(torch.Tensor, layer.fp8_weight_t)
        inputs = layer_scheme(layer).input_activations
        assert inputs is not None, "refusal() lets through quantized activations only"
        padded_in, padded_out = weight_t.shape
        rows = x.reshape(-1, x.shape[-1]).float()
        values, x_scale = quant_math.quantize_activation(
            rows, inputs, cast("torch.Tensor | None", layer.fp8_input_scale)
        )
        x_fp8 = values.to(torch.float8_e4m3fn)
        if padded_in != in_features:
            x_fp8 = F.pad(x_fp8.view(torch.uint8), (0, padded_in - in_features)).view(torch.float8_e4m3fn)
        x_scale = x_scale.float().reshape(-1, 1)
        w_scale = cast(torch.Tensor, layer.fp8_weight_scale)
        if w_scale.numel() > 1 or x_scale.numel() > 1:  # rowwise: both scales per row, bf16 out
            x_scale = x_scale.expand(rows.shape[0], 1).contiguous()
            w_scale = w_scale.expand(1, padded_out).contiguous()
            out = torch._scaled_mm(x_fp8, weight_t, x_scale, w_scale, out_dtype=torch.bfloat16)
        else:
            out = torch._scaled_mm(x_fp8, weight_t, x_scale.reshape(()), w_scale.reshape(()), out_dtype=x.dtype)
        out = out[:, :out_features]
        if bias is not None:
            out = out.float() + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], out_features)


def device_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, None when no CUDA device is visible."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def cuda_linear_methods(capability: tuple[int, int] | None, dense: LinearMethod) -> dict[str, LinearMethod]:
    """The CUDA record's native kernels: int8 always, fp8 where the capability has fp8 tensor cores
    (else its layers dequantized, the reason naming the capability); said once in the log."""
    native: dict[str, LinearMethod] = {W8A8_INT8: Int8ScaledLinear(padded_int_mm, "torch._int_mm, rows padded to 17")}
    if capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY:
        reason = "torch._scaled_mm does not run this fp8 scheme"
        native[FP8] = Fp8ScaledLinear(DequantizedLinear(dense, reason))
        logger.info("cuda capability %d.%d: fp8 linears by torch._scaled_mm", *capability)
    else:
        seen = "no CUDA device visible" if capability is None else "capability {}.{}".format(*capability)
        reason = f"no native fp8 matmul on cuda ({seen}; fp8 tensor cores need >= 8.9)"
        native[FP8] = DequantizedLinear(dense, reason)
        logger.info("fp8 linears dequantized once at load: %s", reason)
    return native
