"""Routed experts with quantized weights, one method per scheme kind, as ops/quantized_linear.py has
for linear layers.

A quantized FusedExperts (module/moe.py) holds its checkpoint's tensors stacked over its experts,
decoded: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] values, `*_scale` and `*_zero_point`
[E, rows, scales per row], `*_input_scale` [E, 1] for static activations. One quantized at load
(`model_config.quantization`) holds its float weights and `quantize_at_load`, rounded here first.

- Int8Experts (W8A8 int8): the backend's moe_experts_int8 (the reference's torch._int_mm per expert on
  the CPU and CUDA, npu_grouped_matmul with per-channel and per-token scales on the NPU).
- DequantizedExperts: every other kind, and W8A8 on a backend without the op: the values
  dequantized once at load into the stacked float tensors, run by the layer's own experts op
  unchanged; a scheme that quantizes activations gets each expert's inputs fake-quantized, computed
  plainly per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from executor.types_.quant_scheme import LinearScheme, QuantArgs
from ops import quant_math, torch_ref
from ops.linear_method import set_layer_attr
from ops.quantized_linear import keep_tensors

if TYPE_CHECKING:
    from ops.backend import Backend

PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantizedExperts(Protocol):
    """What these methods read of a quantized FusedExperts (module/moe.py's set_scheme), and the
    tensors they keep on it: torch types an nn.Module's attributes as tensors and modules."""

    ops: Backend
    scheme: LinearScheme
    compute_dtype: torch.dtype
    quantize_at_load: bool
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    int8_gate_up_proj_t: torch.Tensor  # Int8Experts's buffers
    int8_gate_up_proj_scale: torch.Tensor
    int8_gate_up_proj_input_scale: torch.Tensor | None
    int8_down_proj_t: torch.Tensor
    int8_down_proj_scale: torch.Tensor
    int8_down_proj_input_scale: torch.Tensor | None
    input_scale_values: dict[str, torch.Tensor | None]  # DequantizedExperts's static input scales

    def run_dense_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class StackedWeight:
    """One projection of every expert: values [E, N, K], scale and zero point [E, N, S], input scale [E, 1]."""

    values: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    input_scale: torch.Tensor | None


def stacked_weight(layer: nn.Module, projection: str) -> StackedWeight:
    """The projection as the layer's scheme holds it: its tensors, or its float weights rounded to nearest."""
    experts = cast("QuantizedExperts", layer)
    scheme = experts.scheme
    values = getattr(layer, projection).detach()
    if experts.quantize_at_load:
        parts = [quant_math.quantize_weight(expert, scheme.weights) for expert in values]
        # asymmetric weights round to a zero point each
        zero_points = None if scheme.weights.symmetric else torch.stack([cast(torch.Tensor, p[2]) for p in parts])
        return StackedWeight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), zero_points, None)
    zero_point = getattr(layer, f"{projection}_zero_point", None)
    input_scale = getattr(layer, f"{projection}_input_scale", None)
    return StackedWeight(
        values,
        getattr(layer, f"{projection}_scale").detach(),
        None if zero_point is None else zero_point.detach(),
        None if input_scale is None else input_scale.detach().float().reshape(-1),
    )


class ExpertsMethod:
    """How a FusedExperts under a scheme runs: process_weights once after loading, apply per step."""

    def describe(self, layer: nn.Module) -> str:
        """How this method runs `layer`, for the start-up log."""
        return type(self).__name__

    def process_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError


class Int8Experts(ExpertsMethod):
    """W8A8 int8 experts through the backend's moe_experts_int8, reading int8 W^T per expert, per-channel
    fp32 scales and static input scales kept as the layer's buffers (what the graph modes bind)."""

    def describe(self, layer: nn.Module) -> str:
        return "native int8 experts (moe_experts_int8)"

    def process_weights(self, layer: nn.Module) -> None:
        kept: dict[str, torch.Tensor | None] = {}
        for projection in PROJECTIONS:
            weight = stacked_weight(layer, projection)
            rows = weight.values.shape[1]
            kept[f"int8_{projection}_t"] = weight.values.to(torch.int8).transpose(1, 2).contiguous()
            kept[f"int8_{projection}_scale"] = (
                weight.scale.float().reshape(weight.values.shape[0], -1).expand(-1, rows).contiguous()
            )
            kept[f"int8_{projection}_input_scale"] = weight.input_scale
        keep_tensors(layer, **kept)
        for projection in PROJECTIONS:  # the int8 copies above are what runs
            setattr(layer, projection, nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False))

    def apply(
        self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        experts = cast("QuantizedExperts", layer)
        return experts.ops.moe_experts_int8(
            hidden_states,
            topk_weights,
            topk_ids,
            experts.int8_gate_up_proj_t,
            experts.int8_gate_up_proj_scale,
            experts.int8_down_proj_t,
            experts.int8_down_proj_scale,
            experts.int8_gate_up_proj_input_scale,
            experts.int8_down_proj_input_scale,
        )


class DequantizedExperts(ExpertsMethod):
    """The scheme computed plainly: values dequantized once into the model's dtype, inputs
    fake-quantized per expert where the scheme says."""

    def describe(self, layer: nn.Module) -> str:
        return "dequantized once at load into the stacked experts"

    def process_weights(self, layer: nn.Module) -> None:
        experts = cast("QuantizedExperts", layer)
        args = experts.scheme.weights
        input_scales: dict[str, torch.Tensor | None] = {}
        for projection in PROJECTIONS:
            weight = stacked_weight(layer, projection)
            dense = torch.stack(
                [
                    quant_math.dequantize_weight(
                        values,
                        weight.scale[e],
                        None if weight.zero_point is None else weight.zero_point[e],
                        args,
                        experts.compute_dtype,
                    )
                    for e, values in enumerate(weight.values)
                ]
            )
            setattr(layer, projection, nn.Parameter(dense, requires_grad=False))
            input_scales[projection] = weight.input_scale
        set_layer_attr(layer, "input_scale_values", input_scales)

    def apply(
        self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        experts = cast("QuantizedExperts", layer)
        inputs = experts.scheme.input_activations
        if inputs is None:
            return experts.run_dense_experts(hidden_states, topk_weights, topk_ids)
        return fake_quantized_experts(
            hidden_states,
            topk_weights,
            topk_ids,
            experts.gate_up_proj,
            experts.down_proj,
            inputs,
            experts.input_scale_values["gate_up_proj"],
            experts.input_scale_values["down_proj"],
        )


def fake_quantized_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    inputs: QuantArgs,
    gate_up_input_scale: torch.Tensor | None,
    down_input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """torch_ref.moe_experts with each expert's two inputs quantized and dequantized by `inputs`
    (dynamically, or by the expert's static scale): the plain form of every activation-quantized kind."""

    def fake(x: torch.Tensor, scales: torch.Tensor | None, expert: int) -> torch.Tensor:
        return quant_math.fake_quantize_activation(x, inputs, None if scales is None else scales[expert])

    def expert_forward(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.nn.functional.linear(fake(x, gate_up_input_scale, expert), gate_up_proj[expert])
        activated = fake(torch_ref.silu_and_mul(gate_up), down_input_scale, expert)
        return torch.nn.functional.linear(activated, down_proj[expert])

    return torch_ref.run_grouped(hidden_states, topk_weights, topk_ids, gate_up_proj.shape[0], expert_forward)


INT8_EXPERTS = Int8Experts()  # stateless: one instance serves every layer, as ops/linear_method.PLAIN
DEQUANTIZED_EXPERTS = DequantizedExperts()
