"""Qwen3-Next (transformers' qwen3_next): the hybrid of Qwen3.5 (models/qwen3_5: Gated DeltaNet and
gated attention with partial rope, zero-centred norms) with Qwen3-MoE's layer rule (experts in every
decoder_sparse_step-th layer outside mlp_only_layers, a dense MLP elsewhere) and Qwen3.5-MoE's block
(a sigmoid-gated shared expert; renormalisation as norm_topk_prob says).

Its DeltaNet fuses the input projections: in_proj_qkvz holds, per key head, its query, its key, and
the values and output gates of the value heads it serves; in_proj_ba holds b and a the same way.
`project` unpacks them into Qwen3.5's layout, op for op as transformers' fix_query_key_value_ordering.
Parity with transformers: tests/test_qwen3_5_parity.py.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM
from models.qwen3_5_moe.model import Qwen3_5MoeSparseMoeBlock
from models.qwen3_moe.model import PerExpertCheckpoint, is_sparse_layer
from module.gated_delta_net import GatedDeltaNet
from module.linear import ColumnParallelLinear
from module.parallel_group import ModelParallel
from ops.backend import Backend
from ops.linear_method import LinearMethod


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    def build_projections(self, hidden_size: int, method: LinearMethod) -> None:
        """The fused projections, grouped by key head: a TP rank's run of key heads is a run of rows."""
        tp, ranks = self.tp, self.tp.size
        qkvz_rows = ranks * (self.conv_dim + self.value_dim)
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, qkvz_rows, tp=tp, linear_method=method)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, ranks * 2 * self.num_v_heads, tp=tp, linear_method=method)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = hidden_states.shape[0]
        per_key_head = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(hidden_states).view(num_tokens, self.num_k_heads, -1)
        ba = self.in_proj_ba(hidden_states).view(num_tokens, self.num_k_heads, -1)
        value_width = per_key_head * self.head_v_dim
        query, key, value, z = qkvz.split([self.head_k_dim, self.head_k_dim, value_width, value_width], dim=-1)
        b, a = ba.split([per_key_head, per_key_head], dim=-1)
        mixed = torch.cat([x.reshape(num_tokens, -1) for x in (query, key, value)], dim=-1)
        return mixed, z.reshape(num_tokens, -1), b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)


class Qwen3NextDecoderLayer(Qwen3_5DecoderLayer):
    linear_attention_cls = Qwen3NextGatedDeltaNet

    def build_mlp(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """Qwen3-MoE's rule picks the sparse layers; the others have a dense MLP."""
        if is_sparse_layer(config, layer_index):
            return Qwen3_5MoeSparseMoeBlock(config, parallel, backend)
        return super().build_mlp(config, layer_index, parallel, backend)


class Qwen3NextForCausalLM(PerExpertCheckpoint, Qwen3_5ForCausalLM):
    decoder_layer_cls = Qwen3NextDecoderLayer
