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
fuses the input projections otherwise (models/qwen3_next: build_projections and project). Under
attention TP each rank holds a run of the key heads and the value heads they serve: q, k and v (the
projection's and the conv's channels) are each split over the ranks apart, z, b, a, dt_bias and
A_log by value heads, out_proj by its input; so the conv state is this rank's q, k and v runs and the
recurrent state its value heads (how a prefill instance's ranks join them, online/disagg/kv_copy.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.types_.checkpoint_tensor import LoadedWeight
from executor.types_.errors import WeightLoadError
from executor.types_.kv_cache_spec import KVTensorSpec, TPSplit
from module.linear import ColumnParallelLinear, RowParallelLinear, divide
from module.parallel_group import SINGLE, ParallelGroup
from module.quantized import quant_param
from module.recurrent import RecurrentStateLayer
from module.weights import ShardId, load_shard, set_weight_loader
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


def load_runs(destination: torch.Tensor, loaded: LoadedWeight, runs: tuple[int, ...], tp: ParallelGroup) -> None:
    """Rank tp.rank's share of each run of `loaded`'s rows (whole sizes `runs`: q, k, v), in order."""
    if loaded.shape[0] != sum(runs):
        raise WeightLoadError(f"shape mismatch: expected {sum(runs)} rows (q, k, v: {runs}), got {tuple(loaded.shape)}")
    start = local = 0
    for size in runs:
        share = divide(size, tp.size)
        load_shard(destination.narrow(0, local, share), loaded.narrow(0, start, size), 0, tp.rank, tp.size)
        start, local = start + size, local + share


class RunsColumnParallelLinear(ColumnParallelLinear):
    """Output rows in runs (Qwen3.5's in_proj_qkv: q, k, v) each split over the TP ranks apart,
    loaded from the one checkpoint tensor that holds them all."""

    def __init__(self, input_size: int, runs: tuple[int, ...], tp: ParallelGroup, linear_method: LinearMethod) -> None:
        super().__init__(input_size, sum(runs), tp=tp, linear_method=linear_method)
        self.runs = runs

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        if self.tp_size == 1:
            super().weight_loader(param, loaded_weight, shard_id)
        elif quant_param(param) is not None:
            raise WeightLoadError("a quantized Gated DeltaNet in_proj_qkv is not split over TP ranks: attn_tp_size 1")
        else:
            load_runs(param.data, loaded_weight, self.runs, self.tp)


class DepthwiseConvWeight(nn.Module):
    """Holds the short conv's weight [C, 1, K] under the checkpoint's name (conv1d.weight); its
    channels are q, k and v (whole sizes `runs`), each split over the TP ranks apart."""

    def __init__(self, runs: tuple[int, ...], width: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.runs, self.tp = runs, tp
        self.weight = nn.Parameter(torch.empty(divide(sum(runs), tp.size), 1, width), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        load_runs(param.data, loaded_weight, self.runs, self.tp)


def value_head_vector(num_v_heads: int, fill: float, tp: ParallelGroup) -> nn.Parameter:
    """One value per value head (dt_bias, A_log), this rank's run of them."""
    param = nn.Parameter(torch.full((divide(num_v_heads, tp.size),), fill), requires_grad=False)

    def weight_loader(param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        load_shard(param.data, loaded_weight, 0, tp.rank, tp.size)

    set_weight_loader(param, weight_loader)
    return param


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
        tp: ParallelGroup = SINGLE,
        *,
        backend: Backend,
    ) -> None:
        super().__init__()
        backend.require(GATED_DELTA_NET_OPS, "Gated DeltaNet")
        assert num_v_heads % num_k_heads == 0, f"{num_v_heads} value heads do not group over {num_k_heads} key heads"
        self.ops = backend
        method = backend.linear_method()
        self.tp = tp
        # this rank's: its run of key heads and of the value heads they serve
        self.num_k_heads, self.num_v_heads = divide(num_k_heads, tp.size), divide(num_v_heads, tp.size)
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * head_k_dim, self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = conv_width
        self.activation = activation
        self.eps = eps
        self.state_dtype = backend.dtype  # the conv state's; the recurrent state is fp32
        self.build_projections(hidden_size, method)
        whole_runs = (num_k_heads * head_k_dim, num_k_heads * head_k_dim, num_v_heads * head_v_dim)
        self.conv1d = DepthwiseConvWeight(whole_runs, conv_width, tp)
        self.dt_bias = value_head_vector(num_v_heads, 1.0, tp)
        self.A_log = value_head_vector(num_v_heads, 0.0, tp)
        self.norm = GatedNormWeight(head_v_dim)
        self.out_proj = RowParallelLinear(num_v_heads * head_v_dim, hidden_size, tp=tp, linear_method=method)

    def build_projections(self, hidden_size: int, method: LinearMethod) -> None:
        """The input projections, as Qwen3.5's checkpoints name them: q/k/v, z, b and a apart."""
        tp, ranks = self.tp, self.tp.size
        runs = (ranks * self.key_dim, ranks * self.key_dim, ranks * self.value_dim)
        self.in_proj_qkv = RunsColumnParallelLinear(hidden_size, runs, tp, method)
        self.in_proj_z = ColumnParallelLinear(hidden_size, ranks * self.value_dim, tp=tp, linear_method=method)
        self.in_proj_b = ColumnParallelLinear(hidden_size, ranks * self.num_v_heads, tp=tp, linear_method=method)
        self.in_proj_a = ColumnParallelLinear(hidden_size, ranks * self.num_v_heads, tp=tp, linear_method=method)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (q|k|v [T, conv_dim] before the conv, z [T, value_dim], b and a [T, Hv])."""
        return (
            self.in_proj_qkv(hidden_states),
            self.in_proj_z(hidden_states),
            self.in_proj_b(hidden_states),
            self.in_proj_a(hidden_states),
        )

    def state_tensors(self) -> tuple[KVTensorSpec, ...]:
        """The conv state's channels are this rank's q, k and v runs, the recurrent state's first
        axis its value heads: how a prefill instance's ranks join."""
        runs = (self.key_dim, self.key_dim, self.value_dim)
        state_shape = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return (
            KVTensorSpec(
                "conv_state",
                (self.conv_width - 1, self.conv_dim),
                self.state_dtype,
                tp_split=TPSplit.SEGMENTS,
                tp_dim=1,
                tp_segments=runs,
            ),
            KVTensorSpec("recurrent_state", state_shape, torch.float32, tp_split=TPSplit.HEADS),
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
