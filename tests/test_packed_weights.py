"""Linear layers over packed weights (the CPU backend's LinearMethods, ops/cpu.py, and
ops/csrc/packed_linear.cpp): the same products as F.linear on the plain weight, at every row count,
width and input layout a step produces."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from module.embedding import ParallelLMHead
from module.linear import ColumnParallelLinear, RowParallelLinear
from ops import cpu_kernels
from ops.backend import make_backend
from ops.cpu import (
    AMX_FLAGS,
    AMX_ROWS_MAX,
    AVX2_PANEL_WIDTH,
    AVX512_PANEL_WIDTH,
    PANEL_ROWS_MAX,
    AmxLinear,
    OneDnnLinear,
    PanelLinear,
    cpu_linear_method,
)
from ops.linear_method import LinearMethod, PlainLinear, process_linear_weights

AVX2 = frozenset({"avx2", "fma"})
AVX512 = AVX2 | {"avx512f"}
needs_panels = pytest.mark.skipif(
    cpu_kernels.extension() is None or not AVX2 <= cpu_kernels.cpu_flags(), reason="the CPU has no AVX2/FMA"
)
needs_avx512 = pytest.mark.skipif(
    cpu_kernels.extension() is None or not AVX512 <= cpu_kernels.cpu_flags(), reason="the CPU has no AVX-512"
)
needs_amx = pytest.mark.skipif(
    cpu_kernels.extension() is None
    or not AMX_FLAGS <= cpu_kernels.cpu_flags()
    or not cpu_kernels.extension().amx_available(),
    reason="the CPU has no AMX bf16 (or Linux refuses its tiles)",
)
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# Each panel kernel, on the CPUs that can run it.
PANEL_FLAGS = [pytest.param(AVX2, marks=needs_panels, id="avx2"), pytest.param(AVX512, marks=needs_avx512, id="avx512")]


def panels(flags: frozenset[str] = AVX2) -> LinearMethod:
    return cpu_linear_method(torch.float32, cpu_kernels.extension(), flags)


def onednn() -> LinearMethod:
    return OneDnnLinear()


def layer_with(method: LinearMethod, weight: torch.Tensor) -> ColumnParallelLinear:
    """A layer holding `weight` whose method has processed it (as the worker does after loading)."""
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], bias=False, linear_method=method)
    layer.weight.data = weight
    method.process_weights(layer)
    return layer


@pytest.mark.parametrize("flags", PANEL_FLAGS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 32, 257])
@pytest.mark.parametrize("out_features", [24, 96, 100, 7, 16, 32, 33])
def test_panel_linear_equals_the_plain_product_at_any_rows_and_width(flags, rows, out_features):
    """Row counts that fill the passes (4 rows for AVX2, 12 for AVX-512) and leave each kind of
    remainder; widths that fill the panels (24 or 32 columns) and widths that end in a partial one."""
    weight, bias = torch.randn(out_features, 48), torch.randn(out_features)
    x = torch.randn(rows, 48)
    method = panels(flags)
    layer = layer_with(method, weight)
    torch.testing.assert_close(method.apply(layer, x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(method.apply(layer, x, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_panels
def test_past_the_panel_row_limit_the_plain_weight_serves():
    weight = torch.randn(30, 16)
    method = panels()
    layer = layer_with(method, weight)
    x = torch.randn(PANEL_ROWS_MAX + 1, 16)
    with torch.profiler.profile() as profile:
        out = method.apply(layer, x, None)
    assert "infer_recipes::packed_linear" not in {event.name for event in profile.events()}
    torch.testing.assert_close(out, F.linear(x, weight))
    with torch.profiler.profile() as profile:
        method.apply(layer, x[:PANEL_ROWS_MAX], None)
    assert "infer_recipes::packed_linear" in {event.name for event in profile.events()}


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 32, 257])
def test_onednn_linear_equals_the_plain_product_at_any_row_count(rows):
    weight, bias = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(rows, 48)
    method = onednn()
    layer = layer_with(method, weight)
    torch.testing.assert_close(method.apply(layer, x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [pytest.param(panels, marks=needs_panels), pytest.param(onednn, marks=needs_onednn)])
def test_packed_linear_takes_batched_and_strided_inputs(layout):
    weight = torch.randn(40, 24)
    method = layout()
    layer = layer_with(method, weight)
    batched = torch.randn(3, 5, 24)
    torch.testing.assert_close(method.apply(layer, batched, None), F.linear(batched, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(24, 7).t()  # a transposed view, as attention outputs can be
    torch.testing.assert_close(method.apply(layer, strided, None), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


@needs_panels
def test_fp32_weights_take_the_widest_panels_the_cpu_runs_and_others_onednn():
    for flags, width in ((AVX2, AVX2_PANEL_WIDTH), (AVX512, AVX512_PANEL_WIDTH)):
        method = cpu_linear_method(torch.float32, cpu_kernels.extension(), flags)
        assert isinstance(method, PanelLinear) and method.width == width
    if torch.backends.mkldnn.is_available():
        assert isinstance(cpu_linear_method(torch.bfloat16, cpu_kernels.extension(), AVX512), OneDnnLinear)
        assert isinstance(cpu_linear_method(torch.float32, None, AVX512), OneDnnLinear)


def _kernel_calls(run: Callable[[], torch.Tensor], op: str) -> tuple[torch.Tensor, int]:
    with torch.profiler.profile() as profile:
        out = run()
    return out, sum(event.name == f"infer_recipes::{op}" for event in profile.events())


@pytest.mark.parametrize(
    "method_of, dtype, op",
    [
        *[
            pytest.param(functools.partial(panels, f.values[0]), torch.float32, "packed_linear", marks=f.marks, id=f.id)
            for f in PANEL_FLAGS
        ],
        pytest.param(
            lambda: cpu_linear_method(torch.bfloat16, cpu_kernels.extension(), cpu_kernels.cpu_flags()),
            torch.bfloat16,
            "amx_linear",
            marks=needs_amx,
            id="amx",
        ),
    ],
)
def test_a_compiled_graph_calls_the_kernel_from_its_graph_rows_and_inductors_gemm_below(method_of, dtype, op):
    """Inductor picks MKL's packed GEMM at a verify step's few rows, which reads the weight slower than
    the panels (docs/benchmarks.md): the kernel serves from two rows. At one row inductor's own
    micro-GEMM is as fast as the AVX-512 panels and stays; with AVX2 only it is 1.54x slower than the
    panels there, which serve one row too. The AMX kernel serves bf16 graphs from two rows."""
    weight, bias = torch.randn(40, 32, dtype=dtype), torch.randn(40, dtype=dtype)
    method = method_of()
    layer = layer_with(method, weight)
    compiled = torch.compile(lambda x: method.apply(layer, x, bias), backend="inductor", dynamic=False, fullgraph=True)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    one_row_calls = int(isinstance(method, PanelLinear) and method.width == AVX2_PANEL_WIDTH)
    for rows, calls in ((4, 1), (1, one_row_calls)):
        x = torch.randn(rows, 32, dtype=dtype)
        compiled(x)  # compiles
        out, seen = _kernel_calls(lambda x=x: compiled(x), op)
        assert seen == calls, rows
        torch.testing.assert_close(out, F.linear(x, weight, bias), **tolerance)


def bf16_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) of bf16 tensors summed in fp32 and rounded once: what AMX's exact products give."""
    product = x.float() @ weight.float().t()
    return (product if bias is None else product + bias.float()).to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("out_features, in_features", [(32, 64), (7, 32), (48, 40), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_equals_the_bf16_product_at_any_rows_and_shape(rows, out_features, in_features, with_bias):
    """One or two A tiles a pass, several passes, partial panels of output columns, a K that is not
    whole tile steps (padded): each output the fp32 sum rounded to bf16, at most one bf16 step away
    where the summation order tips a rounding."""
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    packed = cpu_kernels.extension().pack_amx_weight(weight)
    out = torch.ops.infer_recipes.amx_linear(x, packed, bias, out_features)
    expected = bf16_product(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-2)
    assert (out != expected).float().mean() < 0.01  # one step apart only where the order tips it


@needs_amx
def test_bf16_weights_take_the_amx_tiles_where_the_cpu_has_them_and_onednn_past_their_rows():
    method = cpu_linear_method(torch.bfloat16, cpu_kernels.extension(), cpu_kernels.cpu_flags())
    assert isinstance(method, AmxLinear)
    weight = torch.randn(40, 32).to(torch.bfloat16)
    layer = layer_with(method, weight)
    for rows in (3, AMX_ROWS_MAX + 1):
        x = torch.randn(rows, 32).to(torch.bfloat16)
        out, seen = _kernel_calls(lambda x=x: method.apply(layer, x, None), "amx_linear")
        assert seen == (rows <= AMX_ROWS_MAX), rows
        torch.testing.assert_close(out, bf16_product(x, weight, None), rtol=8e-3, atol=1e-2)
    assert isinstance(cpu_linear_method(torch.bfloat16, cpu_kernels.extension(), AVX512), OneDnnLinear)


@needs_panels
def test_an_exported_program_keeps_the_plain_weight():
    """AOTInductor packages hold no weights and bind parameters by name at load; the panels are none."""
    layer = layer_with(panels(), torch.randn(40, 32))
    exported = torch.export.export(layer, (torch.randn(4, 32),))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not any("packed_linear" in target for target in targets), targets


def test_every_linear_and_the_lm_head_get_a_packed_copy_outside_the_state_dict():
    method = make_backend("cpu", "eager", torch.float32).linear_method()
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(16, 32, bias=True, linear_method=method),
            "row": RowParallelLinear(32, 16, bias=True, linear_method=method),
            "lm_head": ParallelLMHead(64, 16, linear_method=method),
        }
    )
    for param in model.parameters():
        param.data.normal_()
    hidden = torch.randn(6, 16)
    rows = torch.tensor([1, 5])
    before = model["lm_head"](model["row"](model["column"](hidden)), rows)
    methods = process_linear_weights(model)
    if isinstance(method, PlainLinear):
        assert methods == ["PlainLinear"]
        return
    assert methods in (["PanelLinear"], ["OneDnnLinear"], ["AmxLinear"])
    assert all(layer.packed_weight is not None for layer in model.values())
    assert not any("packed" in name for name in model.state_dict())
    after = model["lm_head"](model["row"](model["column"](hidden)), rows)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)  # three layers of other-order fp32 sums


@needs_onednn
def test_where_no_layout_takes_the_weight_the_plain_product_runs(monkeypatch):
    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer = layer_with(OneDnnLinear(), torch.randn(4, 8, dtype=torch.bfloat16))  # panels are fp32 only
    assert layer.packed_weight is None
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_without_any_kernel_or_with_prepacking_off_the_weights_stay_plain(monkeypatch):
    assert isinstance(make_backend("cpu", "eager", torch.float32, prepack_weights=False).linear_method(), PlainLinear)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert cpu_linear_method(torch.float32, None, AVX2) is None
    assert isinstance(make_backend("cpu", "eager", torch.float32, cpu_extension=False).linear_method(), PlainLinear)
