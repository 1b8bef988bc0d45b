"""Linear layers over oneDNN's blocked weights (module/blocked_weights.py): the same products as
F.linear on the plain weight, at every row count and input layout a step produces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from module import blocked_weights
from module.blocked_weights import linear, reorder_for_cpu, reorder_linear_weights
from module.embedding import ParallelLMHead
from module.linear import ColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 32, 257])
def test_blocked_linear_equals_the_plain_product_at_any_row_count(rows):
    weight, bias = torch.randn(96, 48), torch.randn(96)
    blocked = reorder_for_cpu(weight)
    assert blocked is not None
    x = torch.randn(rows, 48)
    torch.testing.assert_close(linear(x, weight, bias, blocked), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, weight, None, blocked), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_blocked_linear_takes_batched_and_strided_inputs():
    weight = torch.randn(40, 24)
    blocked = reorder_for_cpu(weight)
    batched = torch.randn(3, 5, 24)
    torch.testing.assert_close(linear(batched, weight, None, blocked), F.linear(batched, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(24, 7).t()  # a transposed view, as attention outputs can be
    torch.testing.assert_close(linear(strided, weight, None, blocked), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_every_linear_and_the_lm_head_get_a_blocked_copy_outside_the_state_dict():
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
    assert reorder_linear_weights(model) == 3
    assert all(layer.blocked_weight is not None for layer in model.values())
    assert not any("blocked" in name for name in model.state_dict())
    after = model["lm_head"](model["row"](model["column"](hidden)), rows)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)  # three layers of other-order fp32 sums


def test_where_onednn_cannot_take_the_weight_the_plain_product_runs(monkeypatch):
    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer = ColumnParallelLinear(8, 4)
    layer.weight.data.normal_()
    assert reorder_linear_weights(layer) == 0
    assert layer.blocked_weight is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_a_weight_on_another_device_or_without_onednn_is_left_plain(monkeypatch):
    assert reorder_for_cpu(torch.randn(4, 4, device="meta")) is None
    monkeypatch.setattr(blocked_weights.torch.backends.mkldnn, "is_available", lambda: False)
    assert reorder_for_cpu(torch.randn(4, 4)) is None
