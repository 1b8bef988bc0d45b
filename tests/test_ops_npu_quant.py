"""The NPU record's quantized linears pass torch_npu's documented arguments (Ascend/op-plugin
docs/context, UNVERIFIED on hardware; ops/npu_quant.py) and, over stand-ins that compute what those
docs say (tests/npu_stand_ins.py), give ops/quant_math.py's reference output.

Tolerances: outputs are bf16 (the matmuls write bf16 or fp16), held to 2% of the largest magnitude;
W8A8 also differs from the reference by npu_dynamic_quant's max|x| / 127 (the reference's / 127.5),
at most one int8 step per value. With the same int8 inputs the matmul is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.model_loader.quantization_config import online_scheme
from executor.types_.quant_scheme import (
    CHANNEL,
    FP8,
    MXFP4,
    MXFP8,
    W4A8,
    W8A8_INT8,
    WNA16,
    LinearScheme,
    QuantArgs,
)
from module.linear import ColumnParallelLinear
from ops import quant_math
from ops.quantized_linear import DequantizedLinear
from tests.npu_stand_ins import QuantRecordingTorchNpu, npu_backend

IN_FEATURES, OUT_FEATURES, ROWS = 64, 48, 5
BF16_TOLERANCE = 0.02
PER_CHANNEL_W8A16 = LinearScheme(QuantArgs(num_bits=8, strategy=CHANNEL))


def quantized_layer(monkeypatch, token: str, dtype: torch.dtype = torch.bfloat16, bias: bool = True):
    """A layer quantized at load by the NPU record's method for `token`, and the stand-in torch_npu."""
    torch_npu = QuantRecordingTorchNpu()
    backend = npu_backend(monkeypatch, "eager", torch_npu)
    scheme = PER_CHANNEL_W8A16 if token == "w8a16_channel" else online_scheme(token, "test")
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, bias=bias)
    layer.weight.data.normal_(0, 0.05)
    if bias:
        layer.bias.data = torch.randn(OUT_FEATURES).to(dtype)
    reference_weight = layer.weight.detach().float().clone()
    layer.set_scheme(scheme, backend.linear_method(scheme.kind), dtype, at_load=True)
    layer.linear_method.process_weights(layer)
    return layer, torch_npu, reference_weight


def reference_output(layer, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The scheme by quant_math: weights rounded to nearest and dequantized, inputs fake-quantized."""
    args = layer.scheme.weights
    dense = quant_math.dequantize_weight(*quant_math.quantize_weight(weight, args), args, torch.float32)
    inputs = x.float()
    if layer.scheme.input_activations is not None:
        inputs = quant_math.fake_quantize_activation(inputs, layer.scheme.input_activations)
    return F.linear(inputs, dense, None if layer.bias is None else layer.bias.float())


def assert_close_to(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert (out.float() - expected).abs().max() <= BF16_TOLERANCE * expected.abs().max()


def test_w8a8_quantizes_per_token_and_multiplies_int8_by_the_transposed_weight(monkeypatch):
    layer, torch_npu, weight = quantized_layer(monkeypatch, "w8a8")
    x = torch.randn(ROWS, IN_FEATURES).to(torch.bfloat16)
    out = layer(x)
    (rows,), _ = torch_npu.last("dynamic_quant")
    assert rows.shape == (ROWS, IN_FEATURES) and rows.dtype == torch.bfloat16
    (x1, x2, scale), kwargs = torch_npu.last("quant_matmul")
    assert x1.dtype == x2.dtype == torch.int8 and x2.shape == (IN_FEATURES, OUT_FEATURES) and x2.is_contiguous()
    assert scale.shape == (OUT_FEATURES,) and scale.dtype == torch.float32
    assert kwargs["pertoken_scale"].shape == (ROWS,) and kwargs["pertoken_scale"].dtype == torch.float32
    assert kwargs["output_dtype"] == torch.bfloat16 and kwargs["bias"].dtype == torch.float32
    w_values, w_scale, _ = quant_math.quantize_weight(weight, layer.scheme.weights)
    exact = quant_math.int8_scaled_mm_reference(
        x1, kwargs["pertoken_scale"].reshape(-1, 1), w_values, w_scale, layer.bias, torch.bfloat16
    )
    assert torch.equal(out, exact)
    assert_close_to(out, reference_output(layer, x, weight))
    assert layer.linear_method.describe(layer) == "native (npu_dynamic_quant + npu_quant_matmul)"


def test_w8a8_in_a_float32_model_gets_bf16_from_the_matmul_and_casts_it_up(monkeypatch):
    layer, torch_npu, weight = quantized_layer(monkeypatch, "w8a8", torch.float32)
    x = torch.randn(ROWS, IN_FEATURES)
    out = layer(x)
    assert out.dtype == torch.float32 and torch_npu.last("quant_matmul")[1]["output_dtype"] == torch.bfloat16
    assert torch_npu.last("dynamic_quant")[0][0].dtype == torch.bfloat16  # the op takes fp16 / bf16
    assert_close_to(out, reference_output(layer, x, weight))


def test_w4a16_groups_pack_int4_and_pass_antiquant_scale_offset_and_group_size(monkeypatch):
    layer, torch_npu, weight = quantized_layer(monkeypatch, "w4a16_asym_g32")
    x = torch.randn(ROWS, IN_FEATURES).to(torch.bfloat16)
    out = layer(x)
    (unpacked,), _ = torch_npu.last("int4pack")
    assert unpacked.dtype == torch.int32 and unpacked.shape == (IN_FEATURES, OUT_FEATURES)
    (rows, packed, scale, offset, quant_scale, quant_offset, bias, group_size), _ = torch_npu.last(
        "weight_quant_batchmatmul"
    )
    groups = IN_FEATURES // 32
    assert packed.dtype == torch.int32 and packed.shape == (IN_FEATURES, OUT_FEATURES // 8)
    assert scale.shape == offset.shape == (groups, OUT_FEATURES) and scale.dtype == torch.bfloat16
    assert group_size == 32 and quant_scale is None and quant_offset is None and bias.dtype == torch.float32
    _, _, zero_point = quant_math.quantize_weight(weight, layer.scheme.weights)
    assert torch.equal(offset, -zero_point.t().to(torch.bfloat16))  # (w + offset) * scale: offset = -zp
    assert_close_to(out, reference_output(layer, x, weight))


def test_w8a16_per_channel_passes_a_scale_per_output_and_no_group(monkeypatch):
    layer, torch_npu, weight = quantized_layer(monkeypatch, "w8a16_channel", bias=False)
    x = torch.randn(ROWS, IN_FEATURES).to(torch.bfloat16)
    out = layer(x)
    (_, packed, scale, offset, *_, group_size), _ = torch_npu.last("weight_quant_batchmatmul")
    assert packed.dtype == torch.int8 and packed.shape == (IN_FEATURES, OUT_FEATURES)
    assert scale.shape == (OUT_FEATURES,) and offset is None and group_size == 0
    assert "int4pack" not in torch_npu.calls
    assert_close_to(out, reference_output(layer, x, weight))


@pytest.mark.parametrize(
    ("token", "dtype", "reason"),
    [
        ("w4a16_g64", torch.bfloat16, "groups of 32k below K=64, not 64"),
        ("w4a16_g32", torch.float32, "fp16/bf16 activations, the model runs torch.float32"),
    ],
)
def test_a_layer_the_npu_kernel_refuses_is_dequantized_with_the_reason(monkeypatch, token, dtype, reason):
    layer, torch_npu, weight = quantized_layer(monkeypatch, token, dtype)
    x = torch.randn(ROWS, IN_FEATURES).to(dtype)
    out = layer(x)
    assert "weight_quant_batchmatmul" not in torch_npu.calls
    assert layer.linear_method.describe(layer).startswith("dequantized once at load: ")
    assert reason in layer.linear_method.describe(layer)
    assert_close_to(out, reference_output(layer, x, weight))


def test_the_npu_record_runs_w8a8_and_wna16_natively_and_dequantizes_the_rest_saying_why(monkeypatch):
    backend = npu_backend(monkeypatch, "eager", QuantRecordingTorchNpu())
    for kind in (W8A8_INT8, WNA16):
        assert not isinstance(backend.linear_method(kind), DequantizedLinear)
    for kind in (W4A8, FP8, MXFP8, MXFP4):
        method = backend.linear_method(kind)
        assert isinstance(method, DequantizedLinear) and "npu" in method.reason
