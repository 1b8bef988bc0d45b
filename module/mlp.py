"""The gated MLP: down(act(gate(x)) * up(x)), with gate and up merged into one matmul; act is SiLU
(SwiGLU) or tanh-approximated GELU (GeGLU, Gemma's gelu_pytorch_tanh)."""

from __future__ import annotations

import torch
from torch import nn

from module.linear import MergedColumnParallelLinear, RowParallelLinear
from module.parallel_group import SINGLE, ParallelGroup
from ops.backend import Backend
from ops.signatures import GatedActivationOp


def gated_activation(backend: Backend, hidden_act: str) -> GatedActivationOp:
    """The backend's op for config `hidden_act`: it applies the activation to the gate half and
    multiplies by the up half."""
    activations = {"silu": backend.silu_and_mul, "gelu_pytorch_tanh": backend.gelu_tanh_and_mul}
    if hidden_act not in activations:
        raise ValueError(f"GatedMLP supports hidden_act {sorted(activations)}, got {hidden_act!r}")
    return activations[hidden_act]


class GatedMLP(nn.Module):
    """Checkpoints name the halves gate_proj and up_proj; models map them onto gate_up_proj's
    shards 0 and 1 (packed_modules_mapping), gate first, the order silu_and_mul reads them in. When
    its TP group spans data-parallel replicas, it runs on every rank's rows of the group
    (gather_rows) and keeps its own."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
        *,
        backend: Backend,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.act_and_mul = gated_activation(backend, hidden_act)
        method = backend.linear_method()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, tp=tp, linear_method=method
        )
        self.ops = backend
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp, linear_method=method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.spans_replicas:
            all_rows, own = self.tp.gather_rows(x)
            return self.down_proj(self.activation(self.gate_up_proj(all_rows)))[own]
        return self.down_proj(self.activation(self.gate_up_proj(x)))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, then up) -> [T, I]: act(gate) * up, act the hidden_act it was built with."""
        return self.act_and_mul(gate_up)
