"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 and Qwen3-Next, over state slots.

Per token: project to q, k, v (one projection, then a causal depthwise conv of width K with SiLU over
their concatenation), to the output gate z, and to beta (sigmoid: how much each token writes) and
the decay g = -exp(A_log) * softplus(a + dt_bias) per value head; run the gated delta rule
(ops/recurrent_ref.py) from the request's state; RMSNorm each head's output gated by silu(z); project
out. The conv keeps the last K - 1 inputs and the rule its [Hv, Dk, Dv] state, both per request,
in the layer's state slots: a step whose rows hold several tokens (prefill, prompt chunks) runs the
chunked rule from each request's state, a decode-shaped step the one-token recurrence.

transformers' Qwen3_5GatedDeltaNet op for op; the parameters keep its names (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a, conv1d.weight [C, 1, K], dt_bias, A_log, norm.weight, out_proj). Qwen3-Next
fuses the input projections otherwise (models/qwen3_next: build_projections and project). One process
only: the heads are not split over attention TP ranks (the model refuses a TP group, naming it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.types_.kv_cache_spec import KVTensorSpec
from module.linear import ColumnParallelLinear, RowParallelLinear
from module.recurrent import RecurrentStateLayer
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.linear_method import LinearMethod

GATED_DELTA_NET_OPS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "rms_norm_gated",
)


class DepthwiseConvWeight(nn.Module):
    """Holds the short conv's weight [C, 1, K] under the checkpoint's name (conv1d.weight)."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width), requires_grad=False)


class GatedNormWeight(nn.Module):
    """Holds the gated norm's weight [head_v_dim] under the checkpoint's name (norm.weight)."""

    def __init__(self, head_v_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_v_dim), requires_grad=False)


class GatedDeltaNet(RecurrentStateLayer):
    keeps_position_states = True  # ops/recurrent_ref.py's ops keep a verify step's states per position

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_width: int,
        eps: float,
        activation: str = "silu",
        *,
        backend: Backend,
    ) -> None:
        super().__init__()
        backend.require(GATED_DELTA_NET_OPS, "Gated DeltaNet")
        assert num_v_heads % num_k_heads == 0, f"{num_v_heads} value heads do not group over {num_k_heads} key heads"
        self.ops = backend
        method = backend.linear_method()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = conv_width
        self.activation = activation
        self.eps = eps
        self.state_dtype = backend.dtype  # the conv state's; the recurrent state is fp32
        self.build_projections(hidden_size, method)
        self.conv1d = DepthwiseConvWeight(self.conv_dim, conv_width)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads), requires_grad=False)
        self.norm = GatedNormWeight(head_v_dim)
        self.out_proj = RowParallelLinear(self.value_dim, hidden_size, linear_method=method)

    def build_projections(self, hidden_size: int, method: LinearMethod) -> None:
        """The input projections, as Qwen3.5's checkpoints name them: q/k/v, z, b and a apart."""
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, self.conv_dim, linear_method=method)
        self.in_proj_z = ColumnParallelLinear(hidden_size, self.value_dim, linear_method=method)
        self.in_proj_b = ColumnParallelLinear(hidden_size, self.num_v_heads, linear_method=method)
        self.in_proj_a = ColumnParallelLinear(hidden_size, self.num_v_heads, linear_method=method)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (q|k|v [T, conv_dim] before the conv, z [T, value_dim], b and a [T, Hv])."""
        return (
            self.in_proj_qkv(hidden_states),
            self.in_proj_z(hidden_states),
            self.in_proj_b(hidden_states),
            self.in_proj_a(hidden_states),
        )

    def state_tensors(self) -> tuple[KVTensorSpec, ...]:
        return (
            KVTensorSpec("conv_state", (self.conv_width - 1, self.conv_dim), self.state_dtype),
            KVTensorSpec("recurrent_state", (self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        )

    def forward(self, hidden_states: torch.Tensor, forward_metadata: ForwardMetaData) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden], each request's states read from and written to its slots."""
        tables = self.state_tables(forward_metadata)
        decode = forward_metadata.is_decode_shaped
        conv_weight = self.conv1d.weight.squeeze(1)
        mixed, gate, b, a = self.project(hidden_states)
        conv = self.ops.causal_conv1d_update if decode else self.ops.causal_conv1d_fn
        mixed = conv(mixed, conv_weight, self.state_caches["conv_state"], tables, self.activation)
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        num_tokens = hidden_states.shape[0]
        query = query.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        key = key.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        value = value.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rule = self.ops.recurrent_gated_delta_rule if decode else self.ops.chunk_gated_delta_rule
        output = rule(query, key, value, g, beta, self.state_caches["recurrent_state"], tables, True)
        gate = gate.reshape(-1, self.head_v_dim)
        output = self.ops.rms_norm_gated(output.reshape(-1, self.head_v_dim), gate, self.norm.weight, self.eps)
        return self.out_proj(output.reshape(num_tokens, self.value_dim))
