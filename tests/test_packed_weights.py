"""Linear layers over packed weights (module/packed_weights.py, ops/csrc/packed_linear.cpp): the same
products as F.linear on the plain weight, at every row count, width and input layout a step produces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from module.packed_weights import PANEL_ROWS_MAX, PackedWeight, linear, pack_for_cpu, pack_linear_weights

from module import packed_weights
from module.embedding import ParallelLMHead
from module.linear import ColumnParallelLinear, RowParallelLinear
from ops import cpu_kernels

needs_panels = pytest.mark.skipif(cpu_kernels.packed_linear() is None, reason="the CPU has no AVX2/FMA")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def panels(weight: torch.Tensor) -> PackedWeight:
    pack_linear_weight, _ = cpu_kernels.packed_linear()
    return PackedWeight(pack_linear_weight(weight), weight.shape[0], "panels")


def onednn(weight: torch.Tensor) -> PackedWeight:
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, 32), weight.shape[0], "onednn")


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 32, 257])
@pytest.mark.parametrize("out_features", [24, 96, 100, 7])
def test_panel_linear_equals_the_plain_product_at_any_rows_and_width(rows, out_features):
    """Row counts that fill four-row passes and each remainder; widths that fill 24-column panels
    and widths that end in a partial one."""
    weight, bias = torch.randn(out_features, 48), torch.randn(out_features)
    x = torch.randn(rows, 48)
    packed = panels(weight)
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, weight, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_panels
def test_past_the_panel_row_limit_the_plain_weight_serves(monkeypatch):
    weight = torch.randn(30, 16)
    packed = panels(weight)
    x = torch.randn(PANEL_ROWS_MAX + 1, 16)
    assert packed.linear(x, None) is None
    assert packed.linear(x[:PANEL_ROWS_MAX], None) is not None
    torch.testing.assert_close(linear(x, weight, None, packed), F.linear(x, weight))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 32, 257])
def test_onednn_linear_equals_the_plain_product_at_any_row_count(rows):
    weight, bias = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(rows, 48)
    packed = onednn(weight)
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [pytest.param(panels, marks=needs_panels), pytest.param(onednn, marks=needs_onednn)])
def test_packed_linear_takes_batched_and_strided_inputs(layout):
    weight = torch.randn(40, 24)
    packed = layout(weight)
    batched = torch.randn(3, 5, 24)
    torch.testing.assert_close(linear(batched, weight, None, packed), F.linear(batched, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(24, 7).t()  # a transposed view, as attention outputs can be
    torch.testing.assert_close(linear(strided, weight, None, packed), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


@needs_panels
def test_on_an_avx2_cpu_without_avx512_fp32_weights_take_panels_and_others_onednn(monkeypatch):
    monkeypatch.setattr(packed_weights, "_has_avx512", lambda: False)
    assert pack_for_cpu(torch.randn(8, 8)).layout == "panels"
    monkeypatch.setattr(packed_weights, "_has_avx512", lambda: True)
    if torch.backends.mkldnn.is_available():
        assert pack_for_cpu(torch.randn(8, 8)).layout == "onednn"


def test_every_linear_and_the_lm_head_get_a_packed_copy_outside_the_state_dict():
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(16, 32, bias=True),
            "row": RowParallelLinear(32, 16, bias=True),
            "lm_head": ParallelLMHead(64, 16),
        }
    )
    for param in model.parameters():
        param.data.normal_()
    hidden = torch.randn(6, 16)
    rows = torch.tensor([1, 5])
    before = model["lm_head"](model["row"](model["column"](hidden)), rows)
    layout = pack_linear_weights(model)
    if cpu_kernels.packed_linear() is None and not torch.backends.mkldnn.is_available():
        assert layout is None
        return
    assert layout in ("panels", "onednn")
    assert all(layer.packed_weight is not None for layer in model.values())
    assert not any("packed" in name for name in model.state_dict())
    after = model["lm_head"](model["row"](model["column"](hidden)), rows)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)  # three layers of other-order fp32 sums


def test_where_no_layout_takes_the_weight_the_plain_product_runs(monkeypatch):
    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer = ColumnParallelLinear(8, 4, bias=False)
    layer.weight.data = torch.randn(4, 8, dtype=torch.bfloat16)  # panels are fp32 only
    assert pack_linear_weights(layer) is None
    assert layer.packed_weight is None
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_a_weight_on_another_device_or_without_any_kernel_is_left_plain(monkeypatch):
    assert pack_for_cpu(torch.randn(4, 4, device="meta")) is None
    monkeypatch.setattr(cpu_kernels, "packed_linear", lambda: None)
    monkeypatch.setattr(packed_weights.torch.backends.mkldnn, "is_available", lambda: False)
    assert pack_for_cpu(torch.randn(4, 4)) is None
