"""The CUDA record's quantized linears, in the parts the CPU runs: torch 2.13's CPU build has
torch._int_mm and torch._scaled_mm too, so Fp8ScaledLinear's layouts, padding and scale recipes
run here for real against ops/quant_math.py's reference (held to 2% of the largest output: the
rowwise recipe writes bf16; the tensorwise one writes fp32 and agrees to 1e-5); the fp8 dispatch is
checked with fake capabilities. The GPU itself runs benchmarks/cuda_quant_check.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.model_loader.quantization_config import online_scheme
from executor.types_.quant_scheme import FLOAT, FP8, TENSOR, W8A8_INT8, LinearScheme, QuantArgs
from module.linear import ColumnParallelLinear
from ops import cuda_quant, quant_math
from ops.linear_method import PLAIN
from ops.quantized_linear import DequantizedLinear, Int8ScaledLinear

PER_TENSOR_FP8 = LinearScheme(QuantArgs(8, FLOAT, TENSOR), QuantArgs(8, FLOAT, TENSOR))


def fp8_layer(scheme: LinearScheme, in_features: int, out_features: int) -> tuple[ColumnParallelLinear, torch.Tensor]:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(in_features, out_features, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_()
    weight = layer.weight.detach().clone()
    method = cuda_quant.Fp8ScaledLinear(DequantizedLinear(PLAIN, "test"))
    layer.set_scheme(scheme, method, torch.float32, at_load=True)
    method.process_weights(layer)
    return layer, weight


def reference(layer: ColumnParallelLinear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    args = layer.scheme.weights
    dense = quant_math.dequantize_weight(*quant_math.quantize_weight(weight, args), args, torch.float32)
    return F.linear(quant_math.fake_quantize_activation(x, layer.scheme.input_activations), dense, layer.bias)


@pytest.mark.parametrize("rows", [3, 20])
def test_padded_int_mm_equals_int_mm_for_few_and_many_rows(rows):
    a = torch.randint(-128, 128, (rows, 32), dtype=torch.int8)
    b = torch.randint(-128, 128, (32, 24), dtype=torch.int8)
    assert torch.equal(cuda_quant.padded_int_mm(a, b), a.int() @ b.int())


def test_fp8_per_channel_runs_rowwise_with_k_and_n_padded_to_16():
    layer, weight = fp8_layer(online_scheme("fp8", "test"), in_features=40, out_features=24)
    assert layer.fp8_weight_t.shape == (48, 32) and layer.fp8_weight_t.stride() == (1, 48)  # column-major
    assert layer.fp8_weight_scale.shape == (1, 32)
    x = torch.randn(5, 40)
    out = layer(x)
    expected = reference(layer, x, weight)
    assert out.shape == (5, 24) and (out - expected).abs().max() <= 0.02 * expected.abs().max()
    assert layer.linear_method.describe(layer) == "native (torch._scaled_mm)"


def test_fp8_per_tensor_runs_tensorwise_in_the_models_dtype():
    layer, weight = fp8_layer(PER_TENSOR_FP8, in_features=32, out_features=16)
    assert layer.fp8_weight_scale.shape == (1, 1)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), reference(layer, x, weight), rtol=1e-5, atol=1e-5)


def test_fp8_blocks_and_weight_only_fp8_are_dequantized_with_the_reason():
    block = LinearScheme(QuantArgs(8, FLOAT, "block", block_structure=(16, 16)), QuantArgs(8, FLOAT, "token"))
    layer, weight = fp8_layer(block, in_features=32, out_features=32)
    assert "not float8 per 16x16 blocks" in layer.linear_method.describe(layer)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), reference(layer, x, weight), rtol=1e-5, atol=1e-5)
    weight_only, _ = fp8_layer(LinearScheme(QuantArgs(8, FLOAT, "channel")), in_features=32, out_features=16)
    assert "unquantized activations" in weight_only.linear_method.describe(weight_only)


@pytest.mark.parametrize(("capability", "native"), [(None, False), ((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_is_native_from_capability_8_9_and_dequantized_below_saying_why(capability, native):
    methods = cuda_quant.cuda_linear_methods(capability, PLAIN)
    assert isinstance(methods[W8A8_INT8], Int8ScaledLinear)
    assert isinstance(methods[FP8], cuda_quant.Fp8ScaledLinear) == native
    if not native:
        seen = "no CUDA device visible" if capability is None else "capability 8.0"
        assert seen in methods[FP8].reason and methods[FP8].reason.startswith("no native fp8 matmul on cuda")
