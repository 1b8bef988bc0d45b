"""Qwen3.5-MoE (transformers' qwen3_5_moe text model, the checkpoints cann-recipes runs as `qwen3.5`):
Qwen3.5's hybrid layers (models/qwen3_5) with a sparse MoE block in every layer: softmax top-k
routing, always renormalised (module/moe.py's SoftmaxTopkRouter, transformers' Qwen3_5MoeTopKRouter
op for op), the stacked routed experts, and one shared expert whose output each token scales by
sigmoid(shared_expert_gate(x)). Parity with transformers: tests/test_qwen3_5_parity.py.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM
from models.qwen3_moe.model import PerExpertCheckpoint
from module.linear import ColumnParallelLinear
from module.mlp import GatedMLP
from module.moe import FusedExperts, SoftmaxTopkRouter, SparseMoeBlock
from module.parallel_group import ModelParallel
from ops.backend import Backend


class Qwen3_5MoeSparseMoeBlock(SparseMoeBlock):
    """Softmax top-k routing (renormalised, or as the config's norm_topk_prob says: Qwen3-Next) over
    the routed experts, and one shared expert whose output each token scales by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: PretrainedConfig, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(
            SoftmaxTopkRouter(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                norm_topk_prob=getattr(config, "norm_topk_prob", True),  # Qwen3.5 always renormalises
            ),
            FusedExperts(
                config.num_experts,
                config.hidden_size,
                config.moe_intermediate_size,
                parallel.moe_tp,
                parallel.moe_ep,
                backend=backend,
            ),
        )
        self.shared_expert = GatedMLP(
            config.hidden_size,
            config.shared_expert_intermediate_size,
            config.hidden_act,
            bias=False,
            tp=parallel.dense_tp,
            backend=backend,
        )
        self.shared_expert_gate = ColumnParallelLinear(config.hidden_size, 1, linear_method=backend.linear_method())

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def build_mlp(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """Every layer's feed-forward block is sparse."""
        return Qwen3_5MoeSparseMoeBlock(config, parallel, backend)


class Qwen3_5MoeForCausalLM(PerExpertCheckpoint, Qwen3_5ForCausalLM):
    """Per-expert checkpoint tensors fill the stacked experts, as in Qwen3-MoE."""

    decoder_layer_cls = Qwen3_5MoeDecoderLayer
