"""Linear layers over packed weights (the CPU backend's LinearMethods, ops/cpu.py, and
ops/csrc/packed_linear.cpp): the same products as F.linear on the plain weight, at every row count,
width and input layout a step produces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from module.embedding import ParallelLMHead
from module.linear import ColumnParallelLinear, RowParallelLinear
from ops import cpu_kernels
from ops.backend import make_backend
from ops.cpu import PANEL_ROWS_MAX, OneDnnLinear, PanelLinear, cpu_linear_method
from ops.linear_method import LinearMethod, PlainLinear, process_linear_weights

AVX2 = frozenset({"avx2", "fma"})
needs_panels = pytest.mark.skipif(
    cpu_kernels.extension() is None or not AVX2 <= cpu_kernels.cpu_flags(), reason="the CPU has no AVX2/FMA"
)
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def panels() -> LinearMethod:
    return cpu_linear_method(torch.float32, cpu_kernels.extension(), AVX2)


def onednn() -> LinearMethod:
    return OneDnnLinear()


def layer_with(method: LinearMethod, weight: torch.Tensor) -> ColumnParallelLinear:
    """A layer holding `weight` whose method has processed it (as the worker does after loading)."""
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], bias=False, linear_method=method)
    layer.weight.data = weight
    method.process_weights(layer)
    return layer


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 32, 257])
@pytest.mark.parametrize("out_features", [24, 96, 100, 7])
def test_panel_linear_equals_the_plain_product_at_any_rows_and_width(rows, out_features):
    """Row counts that fill four-row passes and each remainder; widths that fill 24-column panels
    and widths that end in a partial one."""
    weight, bias = torch.randn(out_features, 48), torch.randn(out_features)
    x = torch.randn(rows, 48)
    method = panels()
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
def test_on_an_avx2_cpu_without_avx512_fp32_weights_take_panels_and_others_onednn():
    assert isinstance(cpu_linear_method(torch.float32, cpu_kernels.extension(), AVX2), PanelLinear)
    if torch.backends.mkldnn.is_available():
        assert isinstance(cpu_linear_method(torch.float32, cpu_kernels.extension(), AVX2 | {"avx512f"}), OneDnnLinear)
        assert isinstance(cpu_linear_method(torch.bfloat16, cpu_kernels.extension(), AVX2), OneDnnLinear)


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
