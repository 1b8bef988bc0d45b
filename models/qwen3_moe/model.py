"""Qwen3-MoE (every checkpoint that loads as transformers' Qwen3MoeForCausalLM): Qwen3's attention with
sparse MoE blocks (softmax top-k routing over routed experts, no shared experts) in every
decoder_sparse_step-th layer outside mlp_only_layers, and Qwen3's dense MLP elsewhere.

The MoE block is module/moe.py's, shared with DeepSeek-V3: SoftmaxTopkRouter (transformers'
Qwen3MoeTopKRouter op for op) and the stacked FusedExperts. Parity with transformers:
tests/test_qwen_parity.py.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn
from transformers import PretrainedConfig

from models.qwen3.model import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM
from module.moe import FusedExperts, SoftmaxTopkRouter, SparseMoeBlock, load_expert_tensor
from module.parallel_group import ModelParallel
from ops.backend import Backend


class Qwen3MoeAttention(Qwen3Attention):
    @staticmethod
    def layer_sliding_window(config: PretrainedConfig, layer_index: int) -> int | None:
        """One window for every layer (the config has no layer_types); None unless use_sliding_window."""
        return config.sliding_window


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(
            SoftmaxTopkRouter(
                config.hidden_size, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob
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


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """transformers' rule: experts in every decoder_sparse_step-th layer (1-based) not in mlp_only_layers."""
    return (
        layer_index not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_index + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    attention_cls = Qwen3MoeAttention

    def build_mlp(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        if is_sparse_layer(config, layer_index):
            return Qwen3MoeSparseMoeBlock(config, parallel, backend)
        return super().build_mlp(config, layer_index, parallel, backend)


class PerExpertCheckpoint:
    """Loading for a causal LM whose checkpoints store one tensor per routed expert and projection:
    they fill the stacked experts (mixed in before the LM class, whose loading handles the rest)."""

    def _load_tensor(
        self, checkpoint_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, Hashable]:
        expert = load_expert_tensor(self, checkpoint_name, tensor)
        return expert if expert is not None else super()._load_tensor(checkpoint_name, tensor, params)

    def _shards_needed(self, name: str) -> int:
        module_name, _, param_name = name.rpartition(".")
        experts = self.get_submodule(module_name)
        if isinstance(experts, FusedExperts):
            return experts.checkpoint_tensors_needed(param_name)
        return super()._shards_needed(name)


class Qwen3MoeForCausalLM(PerExpertCheckpoint, Qwen3ForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer
