"""The few-row linear with int8 rows (ops/csrc/q8_dot_linear.cpp; model_config.wna16_activations):
its row quantization gives llama.cpp's Q8 codes (gguf's Q8_0 quantizer, bit-exact with ggml's reference)
and the plain-torch form of the same rounding exactly; its output is the dequantized row times the
dequantized weight within the fp32 bound of a K-term sum, |y - y_exact| <= (K + 2) * 2^-24 *
(sum_k |x_k w_k| + |b|), the same bit for bit in every form the CPU runs (scalar, AVX2, AVX-512 VNNI);
on a GGUF's Q4_1 blocks it is llama.cpp's Q4_1 x Q8_1 dot product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import Q4_1, Q8_0
from hypothesis import given
from hypothesis import strategies as st

from executor.model_loader.gguf_blocks import decode_q4_1
from executor.types_.quant_scheme import GGUF_BLOCK_SCHEMES, GROUP, LinearScheme, QuantArgs
from module.linear import ColumnParallelLinear
from ops.cpu_kernels import cpu_flags
from ops.cpu_quantized import VNNI_FLAGS, WNA16_ROWS_MAX, Wna16Linear, dequantize_coded
from ops.linear_method import PLAIN
from ops.quantized_linear import DequantizedLinear
from tests.q8_reference import dequantized_rows, q8_blocks
from tests.test_quantized_kernels import FAST, fma_dense, quantized_layer, within_fp32_sum_bound


@FAST
@given(
    rows=st.integers(1, 5),
    blocks=st.integers(1, 8),
    magnitude=st.sampled_from([1e-20, 1e-2, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_row_quantization_gives_gguf_codes_and_the_torch_form_exactly(kernels, rows, blocks, magnitude, seed):
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * magnitude
    x[0, :32] = 0.0  # a zero block: d = 0, codes 0
    codes, d, s = kernels.quantize_q8_blocks(x)
    reference_codes, reference_d = q8_blocks(x)
    assert torch.equal(codes, reference_codes) and torch.equal(d, reference_d)
    assert torch.equal(s, d * codes.view(rows, blocks, 32).sum(-1, dtype=torch.int32).float())
    quantized = Q8_0.quantize_blocks(x.reshape(-1, 32).numpy())  # ggml's reference: fp16 d, then the codes
    assert np.array_equal(quantized[:, 2:].view(np.int8), codes.reshape(-1, 32).numpy())
    assert np.array_equal(quantized[:, :2].view(np.float16), d.reshape(-1, 1).half().numpy())


def test_row_quantization_rounds_ties_to_even(kernels):
    """As llama.cpp's AVX2 row quantizer (its scalar reference rounds ties away from zero)."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # d = 1: the codes are the values rounded
    codes, _, _ = kernels.quantize_q8_blocks(x)
    assert codes[0, :4].tolist() == [127, 0, 2, -2]


@FAST
@given(
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 9),
    out=st.integers(1, 40),
    groups=st.integers(1, 3),
    group=st.sampled_from([32, 64, 96]),
    exactly_half=st.booleans(),
    symmetric=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_row_linear_is_the_dequantized_row_times_the_dequantized_weight(
    kernels, bits, rows, out, groups, group, exactly_half, symmetric, with_bias, seed
):
    generator = torch.Generator().manual_seed(seed)
    features = groups * group
    codes = torch.randint(0, 2**bits, (out, features), dtype=torch.uint8, generator=generator)
    scale = torch.rand(out, groups, generator=generator) * 0.1
    offset = -(2 ** (bits - 1)) * scale if symmetric else -torch.rand(out, groups, generator=generator) * 0.5
    if exactly_half:
        scale, offset = scale.half().float(), offset.half().float()
    packed, scales, offsets = kernels.pack_q8_dot_weight(codes, scale, offset, bits)
    kernel_offset = offset + 128 * scale if bits == 8 else offset  # the 8-bit signed codes' offsets
    is_half = [torch.equal(t.half().float(), t) for t in (scale, kernel_offset)]
    assert scales.dtype == (torch.float16 if all(is_half) else torch.float32)  # fp16 where exact
    assert offsets.numel() == (0 if symmetric and bits == 8 else scales.numel())  # zero offsets left out
    dense = kernels.q8_dot_dequantize(packed, scales, offsets, bits, out)
    kernel_codes = codes.to(torch.int16) - 128 if bits == 8 else codes
    assert torch.equal(dense, fma_dense(kernel_codes, scale, kernel_offset, group))  # c * s + o', one rounding
    x = torch.randn(rows, features, generator=generator)
    bias = torch.randn(out, generator=generator) if with_bias else None
    y = kernels.q8_dot_linear(x, packed, scales, offsets, bias, bits, out)
    assert within_fp32_sum_bound(y, dequantized_rows(x).float(), dense, bias)
    # every form the CPU runs (scalar, AVX2, AVX-512 VNNI, whose 8-bit form reads c + 128 and takes 128 x
    # the row's code sum off) sums each block in integers alike, then scales in one order: bit for bit
    for form in forms_this_cpu_runs():
        assert torch.equal(kernels.q8_dot_linear(x, packed, scales, offsets, bias, bits, out, form), y)


def forms_this_cpu_runs() -> list[int]:
    """q8_dot_linear's forms (its `form` argument): scalar, AVX2, AVX-512 VNNI, as far as the CPU goes."""
    flags = cpu_flags()
    has_avx2 = {"avx2", "fma", "f16c"} <= flags
    return [0] + [1] * has_avx2 + [2] * (has_avx2 and VNNI_FLAGS <= flags)


def test_a_form_the_cpu_lacks_is_refused(kernels):
    packed, scales, offsets = kernels.pack_q8_dot_weight(
        torch.zeros(8, 32, dtype=torch.uint8), *[torch.ones(8, 1)] * 2, 8
    )
    with pytest.raises(RuntimeError, match="form 3 is not one this CPU runs"):
        kernels.q8_dot_linear(torch.ones(1, 32), packed, scales, offsets, None, 8, 8, 3)


def test_int8_rows_on_q4_1_blocks_are_llama_cpps_dot_product(kernels):
    """Q4_1 blocks as gguf writes them (ggml's quantizer), decoded as the loader decodes them: the kernel
    gives sum over blocks of d_w d_x sum(q_w q_x) + m_w s_x, gguf's dequantized weight times the row's
    Q8 codes and scales (llama.cpp's vec_dot_q4_1_q8_1, with d_x kept in fp32 rather than fp16)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 256, generator=generator)
    blocks = Q4_1.quantize_blocks(weight.reshape(-1, 32).numpy()).reshape(24, -1)
    codes, scale, offset = decode_q4_1(blocks)
    packed, scales, offsets = kernels.pack_q8_dot_weight(codes, scale, offset, 4)
    assert scales.dtype == torch.float16  # GGUF's d and m are fp16: read as 5/8 of a byte a weight
    x = torch.randn(2, 256, generator=generator)
    y = kernels.q8_dot_linear(x, packed, scales, offsets, None, 4, 24)
    gguf_weight = torch.from_numpy(Q4_1.dequantize_blocks(blocks.reshape(-1, 20)).reshape(24, 256)).double()
    x_codes, x_d, _ = kernels.quantize_q8_blocks(x)
    expected = (x_codes.double().view(2, -1, 32) * x_d.double()[..., None]).view(2, 256) @ gguf_weight.t()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_pack_refuses_groups_that_are_not_whole_blocks(kernels):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_q8_dot_weight(torch.zeros(3, 48, dtype=torch.uint8), torch.ones(3, 3), torch.zeros(3, 3), 4)


def gguf_block_layer(
    kernels, block_type: str, features: int, out: int, seed: int, setting: str = "auto"
) -> ColumnParallelLinear:
    """A linear layer holding `block_type` blocks as the GGUF loader gives them, its weights processed
    by Wna16Linear with wna16_activations `setting`."""
    generator = torch.Generator().manual_seed(seed)
    layer = ColumnParallelLinear(features, out, bias=False)
    method = Wna16Linear(kernels, DequantizedLinear(PLAIN), setting)
    layer.set_scheme(GGUF_BLOCK_SCHEMES[block_type], method, torch.float32, at_load=False)
    if block_type == "q4_1":
        layer.weight.data = torch.randint(0, 16, (out, features), dtype=torch.uint8, generator=generator)
        layer.weight_offset.data = -torch.rand(out, features // 32, generator=generator).half().float()
    else:
        layer.weight.data = torch.randint(-127, 128, (out, features), dtype=torch.int8, generator=generator)
    layer.weight_scale.data = (torch.rand(out, features // 32, generator=generator) * 0.02).half().float()
    method.process_weights(layer)
    return layer


@pytest.mark.parametrize("block_type", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, WNA16_ROWS_MAX, WNA16_ROWS_MAX + 3])
def test_auto_takes_int8_rows_for_gguf_blocks_up_to_the_row_limit(kernels, block_type, rows):
    """Auto: a GGUF block scheme runs int8 rows up to WNA16_ROWS_MAX rows and the dequantized weight past
    them; the torch dequantization a compiled graph traces gives the kernel's weight."""
    layer = gguf_block_layer(kernels, block_type, 128, 50, seed=2)
    assert layer.wna16_int8_rows
    assert "q8_dot_linear.cpp" in layer.linear_method.describe(layer)
    coded = Wna16Linear.coded(layer)
    dense = kernels.q8_dot_dequantize(coded.codes, coded.scales, coded.offsets, coded.bits, 50)
    assert torch.equal(dequantize_coded(coded), dense)
    x = torch.randn(rows, 128)
    y = layer(x)
    if rows <= WNA16_ROWS_MAX:
        assert within_fp32_sum_bound(y, dequantized_rows(x).float(), dense, None)
        assert not torch.equal(y, F.linear(x, dense))  # the rows were rounded
    else:
        assert within_fp32_sum_bound(y, x, dense, None)


@pytest.mark.parametrize(
    ("setting", "group", "int8_rows"),
    [("auto", 64, False), ("int8", 64, True), ("int8", 16, False)],  # groups of 16: no whole blocks, float
)
def test_the_setting_chooses_the_kernel_per_scheme(kernels, setting, group, int8_rows):
    scheme = LinearScheme(QuantArgs(4, strategy=GROUP, group_size=group))
    layer = quantized_layer(128, 16, scheme, Wna16Linear(kernels, DequantizedLinear(PLAIN), setting), seed=4)
    assert layer.wna16_int8_rows is int8_rows
    assert ("q8_dot_linear.cpp" in layer.linear_method.describe(layer)) is int8_rows


def test_float_keeps_gguf_blocks_on_the_exact_path(kernels):
    layer = gguf_block_layer(kernels, "q4_1", 128, 16, seed=4, setting="float")
    assert not layer.wna16_int8_rows
    assert "wna16_linear.cpp" in layer.linear_method.describe(layer)


def test_an_unknown_setting_is_named(kernels):
    with pytest.raises(ValueError, match="wna16_activations must be one of"):
        Wna16Linear(kernels, DequantizedLinear(PLAIN), "int4")


@pytest.mark.slow
@pytest.mark.long  # a compile; the op in a graph stays in CI through tests/test_gguf_blocks.py's ge_graph test
def test_a_compiled_graph_calls_the_int8_row_kernel(kernels):
    """The kernel is one opaque op in a graph (its fake: ops/cpu.py): compiled and eager agree exactly."""
    layer = gguf_block_layer(kernels, "q4_1", 128, 50, seed=5)
    x = torch.randn(1, 128)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x))
