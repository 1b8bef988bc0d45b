"""Quantization arithmetic in plain torch: the reference every quantized kernel is held to.

The formulas are compressed-tensors' (quantization/utils/helpers.py calculate_qparams and
lifecycle/forward_helpers.py _quantize), so that our int8 activations equal the ones transformers'
fake quantization makes, value for value: a symmetric scale is max|x| / ((qmax - qmin) / 2), an
asymmetric one (max - min) / (qmax - qmin) with zero point qmin - min / scale, values are
round(clamp(x / scale + zero_point)) (a cast for floats), and a zero scale becomes the dtype's eps.
"""

from __future__ import annotations

import torch

from executor.types_.quant_scheme import BLOCK, CHANNEL, FLOAT, GROUP, INT, TENSOR, TOKEN, QuantArgs

E8M0_BIAS = 127
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def group_size(args: QuantArgs) -> int:
    """A group strategy's group size (QuantArgs holds None for the strategies without groups)."""
    assert args.group_size is not None, f"weights per {args.strategy} have no group size"
    return args.group_size


def block_shape(args: QuantArgs) -> tuple[int, int]:
    """A block strategy's [rows, cols] block (QuantArgs holds None for the other strategies)."""
    assert args.block_structure is not None, f"weights per {args.strategy} have no block shape"
    return args.block_structure


def _eps_fix(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def qparams(min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) from per-group minima and maxima, as compressed-tensors' calculate_qparams."""
    zeros = torch.zeros_like(min_vals)
    min_vals, max_vals = torch.minimum(min_vals, zeros), torch.maximum(max_vals, zeros)
    q_min, q_max = args.q_range
    if args.mx:
        return mx_scale(torch.maximum(min_vals.abs(), max_vals), args), zeros
    if args.symmetric:
        return _eps_fix(torch.maximum(min_vals.abs(), max_vals) / ((q_max - q_min) / 2)), zeros
    scale = _eps_fix((max_vals - min_vals) / (q_max - q_min))
    zero_point = torch.clamp(q_min - min_vals / scale, q_min, q_max).round()
    return scale, zero_point


def mx_scale(abs_max: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """An MX group's power-of-two scale: 2^(floor(log2 max) - emax of the element type), as the OCP
    MX spec and compressed-tensors' generate_mx_scales make it (returned as a float)."""
    element_emax = 2 if args.num_bits == 4 else 8
    exponent = torch.floor(torch.log2(abs_max.clamp_min(2.0**-126))) - element_emax
    return torch.exp2(exponent.clamp(-E8M0_BIAS, E8M0_BIAS))


def round_to_type(scaled: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Clamp to the range and round to the nearest representable value (a float tensor)."""
    q_min, q_max = args.q_range
    clamped = torch.clamp(scaled, q_min, q_max)
    if args.type == INT:
        return torch.round(clamped)
    if args.num_bits == 8:
        return clamped.to(torch.float8_e4m3fn).to(scaled.dtype)
    return round_to_fp4(clamped)


def round_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the even code), sign kept."""
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=x.dtype, device=x.device)
    distances = (x.abs().unsqueeze(-1) - grid).abs()
    return grid[distances.argmin(-1)] * x.sign()


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    """round(clamp(x / scale + zp)) with scale broadcast against x: the quantized values, as floats."""
    scaled = x / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(x.dtype)
    return round_to_type(scaled, args)


def dequantize(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """(q - zp) * scale in the scale's dtype."""
    dense = values.to(scale.dtype)
    if zero_point is not None:
        dense = dense - zero_point.to(scale.dtype)
    return dense * scale


# -- activations -----------------------------------------------------------------------------------


def activation_qparams(x: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic (scale, zero point) of activations x [..., K]: one per token, per tensor, or per group."""
    if args.strategy == TOKEN:
        return qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    if args.strategy == TENSOR:
        return qparams(x.amin().reshape(1), x.amax().reshape(1), args)
    if args.strategy == GROUP:
        grouped = x.unflatten(-1, (-1, args.group_size))
        return qparams(grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True), args)
    raise ValueError(f"activations per {args.strategy} are not run here")


def quantize_activation(
    x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 or fp values as floats, scale) of activations: dynamic per token/tensor, or the static scale."""
    if static_scale is not None:
        return quantize(x, static_scale, None, args), static_scale
    scale, zero_point = activation_qparams(x, args)
    if args.strategy == GROUP:
        grouped = x.unflatten(-1, (-1, args.group_size))
        return quantize(grouped, scale, None, args).flatten(-2), scale
    return quantize(x, scale, zero_point if not args.symmetric else None, args), scale


def fake_quantize_activation(
    x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x quantized and dequantized again in x's dtype: what transformers' compressed-tensors forward feeds a
    layer whose inputs are quantized, and what a backend without a native kernel for the scheme runs."""
    if args.strategy == GROUP and static_scale is None:
        grouped = x.unflatten(-1, (-1, args.group_size))
        scale, _ = activation_qparams(x, args)
        return dequantize(quantize(grouped, scale, None, args), scale, None).flatten(-2).to(x.dtype)
    values, scale = quantize_activation(x, args, static_scale)
    zero_point = None
    if not args.symmetric and static_scale is None:
        zero_point = activation_qparams(x, args)[1]
    return dequantize(values, scale.to(x.dtype), zero_point).to(x.dtype)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 values of x by `scale` (broadcast against it; computed in fp32)."""
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 values [T, K], fp32 scales [T, 1]): symmetric, dynamic, max|x| / 127.5."""
    scale = _eps_fix(x.float().abs().amax(-1, keepdim=True) / 127.5)
    return quantize_int8(x, scale), scale


# -- the int8 KV cache (C8) --------------------------------------------------------------------------
# A C8 cache holds int8 values [..., Hkv, D] and their scales in one of two forms, told apart by
# their rank where an op receives them: per slot and KV head, [num_blocks, block_size, Hkv] fp32
# (dynamic: a scale per token and head, written beside the values), or per channel, [Hkv, D] fp32
# (static: from the checkpoint's k_scale / v_scale, a per-tensor scale broadcast to every channel).

KV_INT8 = QuantArgs(num_bits=8, type=INT, strategy=TOKEN, symmetric=True, dynamic=True)


def quantize_kv_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows [T, Hkv, D] -> (int8 values [T, Hkv, D], fp32 scales [T, Hkv]): one symmetric
    scale max|x| / 127.5 per token and head (compressed-tensors' formula), computed in fp32."""
    x32 = x.float()
    scale, _ = qparams(x32.amin(-1, keepdim=True), x32.amax(-1, keepdim=True), KV_INT8)
    return quantize(x32, scale, None, KV_INT8).to(torch.int8), scale.squeeze(-1)


def quantize_kv_static(x: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """K or V rows [T, Hkv, D] -> int8 values by the static per-channel scale [Hkv, D]."""
    return quantize(x.float(), channel_scale, None, KV_INT8).to(torch.int8)


def dequantize_kv(
    values: torch.Tensor,
    dtype: torch.dtype,
    token_scale: torch.Tensor | None = None,
    channel_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 values [..., Hkv, D] as `dtype`: times their per-token-head scales [..., Hkv] and/or the
    per-channel scale [Hkv, D], in fp32."""
    dense = values.float()
    if token_scale is not None:
        dense = dense * token_scale.unsqueeze(-1)
    if channel_scale is not None:
        dense = dense * channel_scale
    return dense.to(dtype)


def fake_quantize_kv(x: torch.Tensor, channel_scale: torch.Tensor | None = None) -> torch.Tensor:
    """K or V rows [T, Hkv, D] quantized to int8 and back, dynamic (per token and head) without
    `channel_scale`, static with it: what a C8 cache gives attention for them."""
    if channel_scale is None:
        values, scale = quantize_kv_per_token_head(x)
        return dequantize_kv(values, x.dtype, token_scale=scale)
    return dequantize_kv(quantize_kv_static(x, channel_scale), x.dtype, channel_scale=channel_scale)


def int8_rescale(
    accumulated: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """An int8 matmul's int32 [T, N] back to fp32: acc * x_scale [T, 1] * w_scale [1, N] (+ bias)."""
    out = accumulated.float() * x_scale * weight_scale
    return out if bias is None else out + bias.float()


# -- weights ---------------------------------------------------------------------------------------


def weight_groups(weight: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale minima and maxima of a [N, K] weight: shapes [1], [N, 1], [N, K/g] or [N/b0, K/b1]."""
    if args.strategy == TENSOR:
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == CHANNEL:
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == GROUP:
        grouped = weight.unflatten(1, (-1, group_size(args)))
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == BLOCK:
        rows, cols = block_shape(args)
        blocks = weight.unflatten(1, (-1, cols)).unflatten(0, (-1, rows))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    raise ValueError(f"weights per {args.strategy} are not run here")


def expand_scale(scale: torch.Tensor, shape: torch.Size, args: QuantArgs) -> torch.Tensor:
    """A weight's scale (or zero point) [1], [N, 1], [N, G] or [N/b0, K/b1] broadcast to the weight's [N, K]."""
    rows, cols = shape
    if args.strategy == GROUP:
        return scale.repeat_interleave(group_size(args), dim=1)[:, :cols]
    if args.strategy == BLOCK:
        block_rows, block_cols = block_shape(args)
        return scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]
    return scale.expand(rows, cols) if scale.numel() > 1 else scale.reshape(1, 1).expand(rows, cols)


def quantize_weight(weight: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round to nearest: a float [N, K] weight -> (values [N, K] as int8 / float8 / fp4-as-float,
    fp32 scale in the scheme's shape, zero point (int8, same shape) or None when symmetric)."""
    weight = weight.float()
    scale, zero_point = qparams(*weight_groups(weight, args), args)
    values = quantize(
        weight, expand_scale(scale, weight.shape, args), expand_scale(zero_point, weight.shape, args), args
    )
    if args.type == INT:
        values = values.to(torch.int8)
    elif args.num_bits == 8:
        values = values.to(torch.float8_e4m3fn)
    return values, scale, None if args.symmetric else zero_point.to(torch.int8)


def dequantize_weight(
    values: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    dtype: torch.dtype,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` that a quantized one stands for: (q - zp) * scale, or with
    a float offset (args.offset) q * scale + offset, rounded in fp32 in that order as gguf's own
    dequantization rounds it. Any rows of a weight will do (an embedding dequantizes the ones it looks up)."""
    shape = values.shape
    full_scale = expand_scale(scale.float(), shape, args)
    full_zero = expand_scale(zero_point, shape, args) if zero_point is not None else None
    dense = dequantize(values.float(), full_scale, full_zero)
    if offset is not None:
        dense = dense + expand_scale(offset.float(), shape, args)
    return dense.to(dtype)


def int8_scaled_mm_reference(
    x_values: torch.Tensor,
    x_scale: torch.Tensor,
    weight_values: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(x_q @ w_q^T) accumulated exactly in int64, times x_scale [T, 1] and w_scale [N, 1] (or [1])."""
    accumulated = x_values.to(torch.int64) @ weight_values.to(torch.int64).t()
    out = accumulated.double() * x_scale.double() * weight_scale.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


__all__ = [
    "BLOCK",
    "CHANNEL",
    "FLOAT",
    "GROUP",
    "INT",
    "TENSOR",
    "TOKEN",
    "activation_qparams",
    "dequantize_kv",
    "dequantize_weight",
    "fake_quantize_activation",
    "fake_quantize_kv",
    "int8_rescale",
    "int8_scaled_mm_reference",
    "quantize_activation",
    "quantize_int8",
    "quantize_int8_per_token",
    "quantize_kv_per_token_head",
    "quantize_kv_static",
    "quantize_weight",
]


def dequantize_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's own MXFP4 layout (`*_blocks` uint8 [..., G, 16], two e2m1 codes a byte, the even
    element in the low nibble, bit 3 the sign; `*_scales` uint8 e8m0 [..., G]) -> values [..., G * 32]
    in `dtype`, as transformers' integrations/mxfp4.py convert_moe_packed_tensors computes them
    (before its final transpose)."""
    magnitudes = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    table = torch.cat((magnitudes, -magnitudes))
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    values = torch.ldexp(table[codes], (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1))
    return values.flatten(-2).to(dtype)
