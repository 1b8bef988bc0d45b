"""torch_npu forms of the quantized linears (Atlas A2/A3), held by the NPU record (ops/backend.py).

None of these ops is in shared/npu-api-facts.md and none has run on hardware: the signatures and
layouts below are torch_npu's documentation as read, UNVERIFIED (sources: Ascend/op-plugin
docs/context/torch_npu-npu_quant_matmul.md, -npu_dynamic_quant.md, -npu_weight_quant_batchmatmul.md,
-npu_convert_weight_to_int4pack.md; the same pages on hiascend.com, "ptaoplist").

- W8A8 int8: `npu_dynamic_quant(x) -> (int8 y, fp32 scale [M])` per token (its scale is max|x| / 127,
  compressed-tensors' max|x| / 127.5: values differ by at most one step from the reference), then
  `npu_quant_matmul(x1 [M, K] int8, x2 [K, N] int8, scale [N] fp32, *, pertoken_scale [M] fp32,
  bias fp32, output_dtype bf16/fp16)` = x1 @ x2 * scale * pertoken_scale + bias. A static input
  scale quantizes in torch and goes in as the per-token scale of every row.
- WNA16: `npu_weight_quant_batchmatmul(x [M, K] fp16/bf16, weight [K, N] int8 (or int32 packing
  eight int4 along N, by npu_convert_weight_to_int4pack), antiquant_scale [N] or [K/g, N],
  antiquant_offset (same shape), quant_scale, quant_offset, bias, antiquant_group_size)` =
  x @ ((weight + offset) * scale) + bias, so the offset is minus the zero point; groups of a
  multiple of 32 in [32, K-1]; bias fp32 for bf16 x, fp16 for fp16 x.
- W4A8, FP8, MXFP8, MXFP4: dequantized at load. npu_quant_matmul multiplies int8 x int8 or int4 x
  int4 on A2/A3 (no int8 x int4); its float8 / float4 / mx inputs are documented for Ascend 950
  only (hicann/ops-nn aclnnQuantMatmulV5), and A2/A3 have no fp8 matmul.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch
from torch import nn

from executor.types_.quant_scheme import FP8, GROUP, MXFP4, MXFP8, TENSOR, TOKEN, W4A8, W8A8_INT8, WNA16
from ops import quant_math
from ops.linear_method import LinearMethod, set_layer_attr
from ops.quantized_linear import DequantizedLinear, NativeLinear, keep_tensors, layer_scheme, quantized_weight

NPU_MAX_K_N = 65535  # both ops: K and N at most 65535
NPU_GROUP_MULTIPLE = 32
HALF_DTYPES = (torch.float16, torch.bfloat16)
NOT_NATIVE = {
    W4A8: "npu_quant_matmul multiplies int8 by int8 or int4 by int4 on A2/A3, no int8 by int4",
    FP8: "no native fp8 matmul on npu A2/A3 (npu_quant_matmul takes float8 on Ascend 950 only)",
    MXFP8: "no native mxfp8 matmul on npu A2/A3 (npu_quant_matmul's mx mode is Ascend 950 only)",
    MXFP4: "no native mxfp4 matmul on npu A2/A3 (npu_quant_matmul's mx mode is Ascend 950 only)",
}


def _size_refusal(layer: nn.Module) -> str | None:
    out_features, in_features = cast(torch.Tensor, layer.weight).shape
    if max(out_features, in_features) > NPU_MAX_K_N:
        return f"the npu's quantized matmuls take K, N <= {NPU_MAX_K_N}, this layer is {out_features}x{in_features}"
    return None


class NpuW8A8Linear(NativeLinear):
    """W8A8 int8 by npu_dynamic_quant + npu_quant_matmul (UNVERIFIED, see the module docstring).
    The matmul writes fp16 or bf16: a float32 model gets bf16 back, cast up."""

    kernel = "npu_dynamic_quant + npu_quant_matmul"

    def __init__(self, torch_npu: ModuleType, fallback: DequantizedLinear) -> None:
        super().__init__(fallback)
        self.torch_npu = torch_npu

    def refusal(self, layer: nn.Module) -> str | None:
        inputs = layer_scheme(layer).input_activations
        assert inputs is not None, "a W8A8 scheme quantizes its activations"
        if not inputs.symmetric:
            return "npu_dynamic_quant quantizes symmetrically, the scheme's activations are asymmetric"
        if inputs.strategy not in (TOKEN, TENSOR) or (inputs.strategy == TENSOR and inputs.dynamic):
            return f"npu W8A8 runs per-token or static per-tensor activations, not {inputs.describe()}"
        return _size_refusal(layer)

    def pack(self, layer: nn.Module) -> None:
        """x2 = int8 W^T [K, N], its per-channel scale [N] fp32, the static input scale [1] (or None)."""
        weight = quantized_weight(layer)
        out_features = weight.values.shape[0]
        keep_tensors(
            layer,
            npu_int8_weight_t=weight.values.to(torch.int8).t().contiguous(),
            npu_int8_scale=weight.scale.float().reshape(-1).expand(out_features).contiguous(),
            npu_int8_input_scale=weight.input_scale,
        )

    def run(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out_dtype = x.dtype if x.dtype in HALF_DTYPES else torch.bfloat16
        rows = x.reshape(-1, x.shape[-1])
        input_scale = cast("torch.Tensor | None", layer.npu_int8_input_scale)
        weight_t = cast(torch.Tensor, layer.npu_int8_weight_t)
        if input_scale is None:
            x_values, x_scale = self.torch_npu.npu_dynamic_quant(rows.to(out_dtype))
        else:
            x_values = quant_math.quantize_int8(rows, input_scale)
            x_scale = input_scale.float().expand(rows.shape[0])
        out = self.torch_npu.npu_quant_matmul(
            x_values,
            weight_t,
            layer.npu_int8_scale,
            pertoken_scale=x_scale,
            bias=None if bias is None else bias.float(),
            output_dtype=out_dtype,
        )
        return out.to(x.dtype).view(*x.shape[:-1], weight_t.shape[1])


class NpuWeightQuantLinear(NativeLinear):
    """WNA16 (int8 or int4 weights, activations in the model's fp16/bf16) by
    npu_weight_quant_batchmatmul (UNVERIFIED, see the module docstring)."""

    kernel = "npu_weight_quant_batchmatmul"

    def __init__(self, torch_npu: ModuleType, fallback: DequantizedLinear) -> None:
        super().__init__(fallback)
        self.torch_npu = torch_npu

    def refusal(self, layer: nn.Module) -> str | None:
        weights = layer_scheme(layer).weights
        out_features, in_features = cast(torch.Tensor, layer.weight).shape
        compute_dtype = cast(torch.dtype, layer.compute_dtype)
        if compute_dtype not in HALF_DTYPES:
            return f"npu_weight_quant_batchmatmul takes fp16/bf16 activations, the model runs {compute_dtype}"
        if weights.strategy == GROUP:
            group_size = quant_math.group_size(weights)
            if group_size % NPU_GROUP_MULTIPLE or not NPU_GROUP_MULTIPLE <= group_size < in_features:
                return f"npu_weight_quant_batchmatmul takes groups of 32k below K={in_features}, not {group_size}"
        if weights.num_bits == 4 and out_features % 8:
            return f"npu_convert_weight_to_int4pack packs N in eights, N is {out_features}"
        return _size_refusal(layer)

    def pack(self, layer: nn.Module) -> None:
        weight = quantized_weight(layer)
        args = layer_scheme(layer).weights
        out_features = weight.values.shape[0]
        transposed = weight.values.t().contiguous()  # [K, N]
        if args.num_bits == 4:
            transposed = self.torch_npu.npu_convert_weight_to_int4pack(transposed.to(torch.int32))
        dtype = cast(torch.dtype, layer.compute_dtype)
        scale = weight.scale.reshape(out_features, -1).t().to(dtype).contiguous()  # [G, N]; [1, N] per channel
        offset = None
        if weight.zero_point is not None:
            offset = (-weight.zero_point.reshape(out_features, -1).t().to(dtype)).contiguous()
        group_size = quant_math.group_size(args) if args.strategy == GROUP else 0
        if group_size == 0:
            scale = scale.reshape(-1).expand(out_features).contiguous()
            offset = None if offset is None else offset.reshape(-1).expand(out_features).contiguous()
        keep_tensors(layer, npu_antiquant_weight=transposed, npu_antiquant_scale=scale, npu_antiquant_offset=offset)
        set_layer_attr(layer, "npu_antiquant_shape", (group_size, out_features))

    def run(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        group_size, out_features = cast("tuple[int, int]", layer.npu_antiquant_shape)
        rows = x.reshape(-1, x.shape[-1])
        if bias is not None:
            bias = bias.float() if x.dtype == torch.bfloat16 else bias.to(x.dtype)
        out = self.torch_npu.npu_weight_quant_batchmatmul(
            rows,
            layer.npu_antiquant_weight,
            layer.npu_antiquant_scale,
            layer.npu_antiquant_offset,
            None,
            None,
            bias,
            group_size,
        )
        return out.view(*x.shape[:-1], out_features)


def npu_linear_methods(torch_npu: ModuleType, dense: LinearMethod) -> dict[str, LinearMethod]:
    """The NPU record's quantized kinds: W8A8 and WNA16 natively (their refused layers and the
    other kinds dequantized at load, each with its reason)."""
    methods: dict[str, LinearMethod] = {kind: DequantizedLinear(dense, reason) for kind, reason in NOT_NATIVE.items()}
    fallback = DequantizedLinear(dense, "refused by the npu kernel")
    methods[W8A8_INT8] = NpuW8A8Linear(torch_npu, fallback)
    methods[WNA16] = NpuWeightQuantLinear(torch_npu, fallback)
    return methods
