"""Kimi Delta Attention (KDA) as a layer: linear attention whose per-request states live in state slots.

q, k and v are projected, pass the short causal convolution with SiLU (ops/recurrent_ref.py's; its
state: the last W - 1 inputs), and feed the per-channel gated delta rule (ops/kda.py; its state:
[heads, K, V] in fp32); the output is RMS-normed per head, gated by sigmoid(output gate), and
projected back. A step whose rows hold several tokens runs the chunked rule from each request's
state, a decode-shaped step the one-token recurrence (module/recurrent.py: the slots and whether a
row continues a state). Kimi-Linear and Ling 3 differ in how they compute the forget gate (a log
decay per channel) and the output gate: subclasses build those (build_gates) and compute them
(forget_gate, output_gate). Heads are split over tensor-parallel ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.kv_cache_spec import KVTensorSpec, TPSplit
from module.linear import ColumnParallelLinear, RowParallelLinear, divide
from module.parallel_group import SINGLE, ParallelGroup
from module.recurrent import RecurrentStateLayer
from module.weights import ShardId, load_shard, set_weight_loader
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.linear_method import LinearMethod

KDA_OPS = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_kda", "recurrent_kda")


def head_sharded(size: int, tp: ParallelGroup) -> nn.Parameter:
    """An fp32 vector of `size` values per head or per head and channel, split over TP ranks by head,
    loaded from a checkpoint tensor of any shape holding the same values (Kimi's A_log is [1, 1, H, 1])."""
    param = nn.Parameter(torch.empty(divide(size, tp.size), dtype=torch.float32), requires_grad=False)

    def weight_loader(param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        load_shard(param.data, materialize(loaded_weight).reshape(-1), 0, tp.rank, tp.size)

    set_weight_loader(param, weight_loader)
    return param


class ShortConvolution(nn.Module):
    """The depthwise convolution's weight [3 x local q/k/v channels, W]: checkpoints hold q_conv1d,
    k_conv1d and v_conv1d ([H * D, 1, W] each), loaded as shards 0, 1, 2 (packed_modules_mapping)."""

    def __init__(self, channels: int, width: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_channels = divide(channels, tp.size)
        self.weight = nn.Parameter(torch.empty(3 * self.local_channels, width), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        assert shard_id in (0, 1, 2), f"the convolution is loaded as its q, k, v shards 0..2, got {shard_id!r}"
        part = param.data.narrow(0, shard_id * self.local_channels, self.local_channels)
        load_shard(part, materialize(loaded_weight).flatten(1), 0, self.tp.rank, self.tp.size)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels times sigmoid(gate), all in fp32 (FLA's and transformers'
    gated norm for KDA; Gated DeltaNet's gates by SiLU and weighs in the input's dtype instead)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(RecurrentStateLayer):
    """Checkpoint names as Kimi-Linear's and Ling 3's: q_proj, k_proj, v_proj, {q,k,v}_conv1d,
    b_proj, A_log, dt_bias, o_norm, o_proj, plus each family's gate projections. Its ops keep a verify
    step's state after every position (speculative decoding)."""

    keeps_position_states = True

    def __init__(self, config: PretrainedConfig, tp: ParallelGroup = SINGLE, *, backend: Backend) -> None:
        super().__init__()
        backend.require(KDA_OPS, "Kimi delta attention")
        self.ops = backend
        method = backend.linear_method()
        hidden_size = config.hidden_size
        self.head_dim = config.linear_head_dim
        total_heads = config.linear_num_heads
        self.num_heads = divide(total_heads, tp.size)
        self.conv_width = config.linear_conv_kernel_dim
        width = total_heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (
            ColumnParallelLinear(hidden_size, width, tp=tp, linear_method=method) for _ in range(3)
        )
        self.conv1d = ShortConvolution(width, self.conv_width, tp)
        self.b_proj = ColumnParallelLinear(hidden_size, total_heads, tp=tp, linear_method=method)
        self.A_log = head_sharded(total_heads, tp)
        self.dt_bias = head_sharded(width, tp)
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(width, hidden_size, tp=tp, linear_method=method)
        self.build_gates(config, tp, method)
        self.state_dtype = backend.dtype  # the conv state's; the recurrent state is fp32

    def build_gates(self, config: PretrainedConfig, tp: ParallelGroup, method: LinearMethod) -> None:
        """Build the projections forget_gate and output_gate read."""
        raise NotImplementedError

    def forget_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> log decay [T, local heads, head_dim] in fp32 (<= 0)."""
        raise NotImplementedError

    def output_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> the gate of the output norm [T, local heads * head_dim]."""
        raise NotImplementedError

    def decay_rate(self) -> torch.Tensor:
        """exp(A_log) [1, local heads, 1]: each head's decay rate, broadcast over its channels."""
        return self.A_log.exp().view(1, -1, 1)

    def gate_input(self, projected: torch.Tensor) -> torch.Tensor:
        """A forget gate projection [T, local heads * head_dim] plus dt_bias, per head, in fp32."""
        return (projected.float() + self.dt_bias).view(-1, self.num_heads, self.head_dim)

    def state_tensors(self) -> tuple[KVTensorSpec, ...]:
        """The conv state's channels are this rank's q, k and v heads' runs (each split by heads
        apart), the recurrent state's first axis its heads: how a prefill instance's ranks join."""
        width = self.num_heads * self.head_dim
        conv_shape, state_shape = (self.conv_width - 1, 3 * width), (self.num_heads, self.head_dim, self.head_dim)
        return (
            KVTensorSpec(
                "conv_state",
                conv_shape,
                self.state_dtype,
                tp_split=TPSplit.SEGMENTS,
                tp_dim=1,
                tp_segments=(width,) * 3,
            ),
            KVTensorSpec("recurrent_state", state_shape, torch.float32, tp_split=TPSplit.HEADS),
        )

    def forward(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, ...], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; `rotary` is unused (KDA has no positions)."""
        tables = self.state_tables(forward_metadata)
        decode = forward_metadata.is_decode_shaped
        mixed = torch.cat((self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)), -1)
        conv = self.ops.causal_conv1d_update if decode else self.ops.causal_conv1d_fn
        mixed = conv(mixed, self.conv1d.weight, self.state_caches["conv_state"], tables, "silu")
        query, key, value = mixed.view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        beta = torch.sigmoid(self.b_proj(hidden_states).float())
        rule = self.ops.recurrent_kda if decode else self.ops.chunk_kda
        gate = self.forget_gate(hidden_states)
        output = rule(query, key, value, gate, beta, self.state_caches["recurrent_state"], tables)
        output = self.o_norm(output, self.output_gate(hidden_states).view(output.shape))
        return self.o_proj(output.flatten(1))
