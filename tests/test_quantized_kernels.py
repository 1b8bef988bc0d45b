"""The CPU's quantized kernels against the plain-torch reference (ops/quant_math.py): W8A8's per-token
quantization and rescale, and the one-kernel VNNI linear, give its values exactly; the weight-only
4/8-bit linear dequantizes to the same weights exactly and multiplies within the fp32 rounding bound of a K-term sum,
|y - y_exact| <= (K + 2) * 2^-24 * (sum_k |x_k w_k| + |b|)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.model_loader.quantization_config import QuantizationRequest, read_quantization
from executor.types_.quant_scheme import GROUP, W8A8_INT8, WNA16, LinearScheme, QuantArgs
from module.linear import ColumnParallelLinear
from module.quantized import QuantizationError
from ops import cpu_kernels, quant_math
from ops.backend import make_backend
from ops.cpu_quantized import (
    VNNI_FLAGS,
    WNA16_ROWS_MAX,
    CpuInt8Kernels,
    Int16MaddInt8Linear,
    VnniInt8Linear,
    Wna16Linear,
    coded_weight,
    dequantize_coded,
)
from ops.linear_method import PLAIN
from ops.quantized_linear import DequantizedLinear, Int8ScaledLinear

UNIT_ROUNDOFF = 2.0**-24
FAST = settings(max_examples=25, deadline=None)
HAS_VNNI = VNNI_FLAGS <= cpu_kernels.cpu_flags()
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="int8_linear.cpp needs AVX-512 VNNI, which this CPU lacks")


# -- W8A8: per-token quantization and rescale ---------------------------------------------------------


@FAST
@given(
    tokens=st.integers(1, 40),
    features=st.integers(1, 700),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_int8_quantization_equals_the_reference_exactly(kernels, tokens, features, magnitude, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=generator) * magnitude
    x[0] = 0.0  # an all-zero row takes the eps scale
    values, scale = kernels.quantize_int8_per_token(x)
    expected_values, expected_scale = quant_math.quantize_int8_per_token(x)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(values, expected_values)


def test_int8_quantization_rounds_ties_to_even(kernels):
    row = torch.tensor([[127.5, 0.5, 1.5, 2.5, -0.5, -1.5, -127.5]])  # max 127.5: scale exactly 1
    values, scale = kernels.quantize_int8_per_token(row)
    assert scale.item() == 1.0
    assert values.tolist() == [[127, 0, 2, 2, 0, -2, -128]]


@FAST
@given(tokens=st.integers(1, 33), out=st.integers(1, 300), with_bias=st.booleans(), per_tensor=st.booleans())
def test_int8_rescale_equals_the_reference_exactly(kernels, tokens, out, with_bias, per_tensor):
    accumulated = torch.randint(-(2**24), 2**24, (tokens, out), dtype=torch.int32)
    x_scale = torch.rand(1, 1) if per_tensor else torch.rand(tokens, 1)
    w_scale, bias = torch.rand(1, out), torch.randn(out) if with_bias else None
    expected = quant_math.int8_rescale(accumulated, x_scale, w_scale, bias)
    assert torch.equal(kernels.int8_rescale(accumulated, x_scale, w_scale, bias), expected)


def test_w8a8_with_the_kernels_equals_w8a8_in_plain_torch(kernels):
    scheme = LinearScheme(QuantArgs(8), QuantArgs(8, strategy="token", dynamic=True))
    int8 = CpuInt8Kernels(kernels)
    x = torch.randn(2, 5, 96)
    outputs = []
    for method in (Int8ScaledLinear(), Int8ScaledLinear(torch._int_mm, "torch._int_mm", int8.quantize, int8.rescale)):
        layer = quantized_layer(96, 40, scheme, method, seed=3)
        outputs.append(layer(x))
    assert torch.equal(outputs[0], outputs[1])


def plain_w8a8(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias, input_scale) -> torch.Tensor:
    """W8A8 in plain torch: quantize (per token, or by the static scale), int32 sums, rescale."""
    if input_scale is None:
        values, x_scale = quant_math.quantize_int8_per_token(x)
    else:
        x_scale = input_scale.reshape(1, 1)
        values = quant_math.quantize_int8(x, x_scale)
    accumulated = (values.long() @ weight.long().t()).to(torch.int32)
    return quant_math.int8_rescale(accumulated, x_scale, w_scale.reshape(1, -1), bias)


@needs_vnni
@FAST
@given(
    tokens=st.integers(1, 300),
    features=st.integers(1, 200),
    out=st.integers(1, 100),
    with_bias=st.booleans(),
    static=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_vnni_int8_linear_equals_the_reference_exactly(kernels, tokens, features, out, with_bias, static, seed):
    """Every tile shape (row and panel tails), K past a multiple of 4, and the extreme weights -128
    and 127, whose compensation is largest."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=generator) * 3
    weight = torch.randint(-128, 128, (out, features), dtype=torch.int8, generator=generator)
    weight[0, :] = -128
    w_scale = torch.rand(out, generator=generator)
    bias = torch.randn(out, generator=generator) if with_bias else None
    input_scale = torch.tensor([0.02]) if static else None
    packed, compensation = kernels.pack_int8_weight(weight)
    y = kernels.int8_linear_forward(x, packed, compensation, w_scale, input_scale, bias, out)
    assert torch.equal(y, plain_w8a8(x, weight, w_scale, bias, input_scale))


@needs_vnni
def test_vnni_method_equals_w8a8_in_plain_torch_across_a_row_chunk(kernels):
    """Through the layer: more rows than one chunk of the kernel (128), a 3D input."""
    scheme = LinearScheme(QuantArgs(8), QuantArgs(8, strategy="token", dynamic=True))
    x = torch.randn(3, 100, 96)
    plain, vnni = (
        quantized_layer(96, 70, scheme, method, seed=3) for method in (Int8ScaledLinear(), VnniInt8Linear(kernels))
    )
    assert torch.equal(vnni(x), plain(x))


needs_avx2 = pytest.mark.skipif("avx2" not in cpu_kernels.cpu_flags(), reason="int16_madd_mm.cpp needs AVX2")


@needs_avx2
@FAST
@given(
    rows=st.integers(1, 40),
    features=st.integers(1, 200),
    out=st.integers(1, 60),
    seed=st.integers(0, 2**16),
)
def test_int16_madd_matmul_equals_int_mm_exactly(kernels, rows, features, out, seed):
    """Every register block's row and panel tails, odd K, and the extreme values -128 and 127 on both
    sides (whose products vpmaddubsw's 16-bit pair sums would saturate)."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (rows, features), dtype=torch.int8, generator=generator)
    weight = torch.randint(-128, 128, (out, features), dtype=torch.int8, generator=generator)
    a[0, :], weight[0, :] = -128, -128
    y = kernels.int16_madd_mm(a, kernels.pack_int16_madd_weight(weight), out)
    assert torch.equal(y, (a.long() @ weight.long().t()).to(torch.int32))


@needs_avx2
@pytest.mark.parametrize("static", [False, True])
def test_int16_madd_method_equals_w8a8_in_plain_torch(kernels, static):
    scheme = LinearScheme(QuantArgs(8), QuantArgs(8, strategy="token", dynamic=not static))
    x = torch.randn(3, 11, 96)
    plain, avx2 = (
        quantized_layer(96, 70, scheme, method, seed=3) for method in (Int8ScaledLinear(), Int16MaddInt8Linear(kernels))
    )
    if static:
        for layer in (plain, avx2):
            layer.int8_input_scale = torch.tensor([0.02])
    assert "int16_madd_mm.cpp" in avx2.linear_method.describe(avx2)
    assert torch.equal(avx2(x), plain(x))


@needs_avx2
@pytest.mark.slow
@pytest.mark.long  # a compile; W8A8 in graphs stays in CI through tests/test_quantized_graph_modes.py
def test_a_compiled_graph_calls_the_int16_madd_matmul(kernels):
    scheme = LinearScheme(QuantArgs(8), QuantArgs(8, strategy="token", dynamic=True))
    layer = quantized_layer(96, 70, scheme, Int16MaddInt8Linear(kernels), seed=3)
    x = torch.randn(4, 96)
    assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x), layer(x))


def test_cpu_record_takes_the_avx2_int8_matmul_where_vnni_is_missing(kernels):
    has_avx2 = "avx2" in cpu_kernels.cpu_flags()
    expected = VnniInt8Linear if HAS_VNNI else Int16MaddInt8Linear if has_avx2 else Int8ScaledLinear
    assert type(make_backend("cpu").linear[W8A8_INT8]) is expected


# -- weight-only 4/8-bit ------------------------------------------------------------------------------


def fma_dense(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """u * s + o rounded once to fp32 (the product and sum are exact in float64 at these widths)."""
    full_scale = scale.double().repeat_interleave(group, 1)
    return (codes.double() * full_scale + offset.double().repeat_interleave(group, 1)).float()


def within_fp32_sum_bound(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> bool:
    exact = x.double() @ dense.double().t()
    magnitude = x.double().abs() @ dense.double().abs().t()
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    bound = (x.shape[1] + 2) * UNIT_ROUNDOFF * magnitude
    return bool(((y.double() - exact).abs() <= bound).all())


@FAST
@given(
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 9),
    out=st.integers(1, 70),
    groups=st.integers(1, 4),
    group=st.sampled_from([2, 32, 64, 96]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_wna16_linear_matches_the_dequantized_weight(kernels, bits, rows, out, groups, group, with_bias, seed):
    generator = torch.Generator().manual_seed(seed)
    features = groups * group
    codes = torch.randint(0, 2**bits, (out, features), dtype=torch.uint8, generator=generator)
    scale = torch.rand(out, groups, generator=generator) * 0.1
    offset = -torch.rand(out, groups, generator=generator) * 0.5  # any (d, m): GGUF Q4_1's form too
    packed, scales, offsets = kernels.pack_wna16_weight(codes, scale, offset, bits)
    dense = fma_dense(codes, scale, offset, group)
    assert torch.equal(kernels.wna16_dequantize(packed, scales, offsets, bits, out), dense)
    x = torch.randn(rows, features, generator=generator)
    bias = torch.randn(out, generator=generator) if with_bias else None
    y = kernels.wna16_linear(x, packed, scales, offsets, bias, bits, out)
    assert within_fp32_sum_bound(y, x, dense, bias)


def test_wna16_pack_refuses_codes_wider_than_the_bits(kernels):
    codes = torch.full((3, 4), 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="does not fit 4 bits"):
        kernels.pack_wna16_weight(codes, torch.ones(3, 1), torch.zeros(3, 1), 4)


def quantized_layer(features: int, out: int, scheme: LinearScheme, method, seed: int) -> ColumnParallelLinear:
    """A linear layer quantized at load by `scheme` under `method`, its weights processed."""
    layer = ColumnParallelLinear(features, out, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, features, generator=torch.Generator().manual_seed(seed)) * 0.05)
    layer.set_scheme(scheme, method, torch.float32, at_load=True)
    method.process_weights(layer)
    return layer


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows", [1, WNA16_ROWS_MAX, WNA16_ROWS_MAX + 5])
def test_wna16_method_matches_the_scheme_computed_plainly(kernels, bits, symmetric, rows):
    """Through the kernel (rows <= WNA16_ROWS_MAX) and dequantized per call (more rows), against
    DequantizedLinear's weight ((q - zp) * s in fp32) and F.linear."""
    scheme = LinearScheme(QuantArgs(bits, strategy=GROUP, group_size=32, symmetric=symmetric))
    reference = quantized_layer(128, 50, scheme, DequantizedLinear(PLAIN), seed=1)
    # float: the exact path (auto takes int8 rows for 8-bit groups of 32, GGUF's Q8_0: tests/test_q8_dot_kernel.py)
    layer = quantized_layer(128, 50, scheme, Wna16Linear(kernels, DequantizedLinear(PLAIN), "float"), seed=1)
    assert layer.wna16_bits == bits
    dense = reference.weight.detach()
    # Symmetric offsets (-2^(b-1) s) are exact, so the weights are the reference's to the bit; a
    # zero point's offset is rounded once more.
    coded = Wna16Linear.coded(layer)
    assert coded is not None and not coded.int8_rows
    torch_dense = dequantize_coded(coded)
    assert torch.equal(torch_dense, kernels.wna16_dequantize(coded.codes, coded.scales, coded.offsets, bits, 50))
    if symmetric:
        assert torch.equal(torch_dense, dense)
    else:
        torch.testing.assert_close(torch_dense, dense, rtol=0, atol=4 * UNIT_ROUNDOFF * dense.abs().max().item())
    x = torch.randn(rows, 128)
    y = layer(x)
    assert within_fp32_sum_bound(y, x, dense, None) if symmetric else torch.allclose(y, F.linear(x, dense), atol=1e-5)


def test_wna16_runs_plainly_where_the_kernel_does_not_take_the_layer(kernels):
    scheme = LinearScheme(QuantArgs(4, strategy=GROUP, group_size=32))
    layer = ColumnParallelLinear(64, 8, bias=False)
    layer.set_scheme(scheme, None, torch.bfloat16, at_load=True)
    assert coded_weight(kernels, layer, int8_rows=True) is None  # a bf16 model


def test_cpu_record_takes_the_quantized_kernels_where_they_built(kernels):
    built = make_backend("cpu")
    assert isinstance(built.linear[WNA16], Wna16Linear)
    if HAS_VNNI:
        assert built.linear[W8A8_INT8].kernels is kernels
    else:
        assert built.linear[W8A8_INT8].quantize.__self__.kernels is kernels
    bf16 = make_backend("cpu", dtype=torch.bfloat16)  # int8_linear.cpp writes fp32
    assert bf16.linear[W8A8_INT8].quantize.__self__.kernels is kernels
    reference_only = make_backend("cpu", cpu_extension=False)
    assert isinstance(reference_only.linear[WNA16], DequantizedLinear)
    assert reference_only.linear[W8A8_INT8].quantize is quant_math.quantize_int8_per_token


# -- the build and the plan ---------------------------------------------------------------------------


def test_the_build_is_named_by_its_sources_and_their_folder():
    flags, here, there = ["-mavx2"], Path("/a/ops/csrc"), Path("/b/ops/csrc")
    assert cpu_kernels.build_name(flags, ["a", "b"], here) == cpu_kernels.build_name(flags, ["a", "b"], here)
    assert cpu_kernels.build_name(flags, ["a", "b"], here) != cpu_kernels.build_name(flags, ["a", "c"], here)
    assert cpu_kernels.build_name(flags, ["a"], here) != cpu_kernels.build_name([], ["a"], here)
    assert cpu_kernels.build_name(flags, ["a"], here) != cpu_kernels.build_name(flags, ["a"], there)  # checkouts


def test_a_build_lock_left_by_a_killed_load_is_removed_once_stale_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """torch's loader would wait on it for ever: every later run hung before its first step."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "infer_recipes_cpu_kernels_x" / "lock"
    lock.parent.mkdir()
    lock.touch()
    cpu_kernels.clear_stale_build_lock("infer_recipes_cpu_kernels_x")
    assert lock.exists()  # a build may hold it now
    stale = time.time() - cpu_kernels.STALE_BUILD_LOCK_S - 1
    os.utime(lock, (stale, stale))
    cpu_kernels.clear_stale_build_lock("infer_recipes_cpu_kernels_x")
    assert not lock.exists()


class _Config:
    quantization_config = None


def test_lm_head_token_quantizes_the_lm_head_too():
    default = read_quantization(_Config(), QuantizationRequest("w8a8"), "test")
    assert default.scheme_for("lm_head") is None
    included = read_quantization(_Config(), QuantizationRequest("w8a8+lm_head"), "test")
    assert included.scheme_for("lm_head") == included.scheme_for("model.layers.0.mlp.down_proj")


def test_lm_head_token_alone_is_refused():
    with pytest.raises(QuantizationError, match="lm_head goes with a weight scheme"):
        read_quantization(_Config(), QuantizationRequest("lm_head"), "test")
