"""Qwen2 / Qwen2.5 (every checkpoint that loads as transformers' Qwen2ForCausalLM): Llama with a bias
on q/k/v (none on o_proj or the MLP) and, where config.layer_types says so, sliding-window layers.

Only those differences are written here; the rest is models/llama. Parity with transformers:
tests/test_qwen_parity.py.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from module.mlp import GatedMLP
from module.parallel_group import ModelParallel
from ops.backend import Backend


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """Qwen2 always has q/k/v biases and no o_proj bias (its config has no attention_bias)."""
        return True, False

    @staticmethod
    def layer_sliding_window(config: PretrainedConfig, layer_index: int) -> int | None:
        """config.sliding_window in the layers layer_types marks sliding (transformers derives them
        from use_sliding_window and max_window_layers, and sets sliding_window None without it)."""
        return config.sliding_window if config.layer_types[layer_index] == "sliding_attention" else None


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention

    def build_mlp(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """A SwiGLU MLP without biases (Qwen2's config has no mlp_bias)."""
        return GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, tp=parallel.dense_tp, backend=backend
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer
