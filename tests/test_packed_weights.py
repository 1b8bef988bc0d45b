"""Linear layers over packed weights (the CPU backend's LinearMethods, ops/cpu.py, and
ops/csrc/packed_linear.cpp): the same products as F.linear on the plain weight, at every row count,
width and input layout a step produces."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from module.embedding import ParallelLMHead
from module.linear import ColumnParallelLinear, RowParallelLinear
from ops import cpu_kernels
from ops.backend import make_backend
from ops.cpu import (
    AVX2_PANEL_WIDTH,
    AVX512_PANEL_WIDTH,
    PANEL_ROWS_MAX,
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


def _panel_calls(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    with torch.profiler.profile() as profile:
        out = run()
    return out, sum(event.name == "infer_recipes::packed_linear" for event in profile.events())


@pytest.mark.parametrize("flags", PANEL_FLAGS)
def test_a_compiled_graph_calls_the_panels_from_two_rows_and_inductors_gemm_at_one(flags):
    """Inductor picks MKL's packed GEMM at a verify step's few rows, which reads the weight slower than
    the panels (docs/benchmarks.md); at one row its own micro-GEMM is as fast and stays."""
    weight, bias = torch.randn(40, 32), torch.randn(40)
    method = panels(flags)
    layer = layer_with(method, weight)
    compiled = torch.compile(lambda x: method.apply(layer, x, bias), backend="inductor", dynamic=False, fullgraph=True)
    for rows, calls in ((4, 1), (1, 0)):
        x = torch.randn(rows, 32)
        compiled(x)  # compiles
        out, seen = _panel_calls(lambda x=x: compiled(x))
        assert seen == calls, rows
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


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
    assert methods in (["PanelLinear"], ["OneDnnLinear"])
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
