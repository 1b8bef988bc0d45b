"""Qwen3 (every checkpoint that loads as transformers' Qwen3ForCausalLM): Qwen2's layers with an
RMSNorm over each head of q and k before rope, head_dim from the config, and Llama's attention_bias
(off in the released models) instead of Qwen2's fixed q/k/v biases.

Only those differences are written here; the rest is models/qwen2 and models/llama. Parity with
transformers: tests/test_qwen_parity.py.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from models.llama.model import LlamaAttention
from models.qwen2.model import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM
from module.norm import RMSNorm
from module.parallel_group import ModelParallel
from ops.backend import Backend


class Qwen3Attention(Qwen2Attention):
    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """attention_bias on q/k/v and o_proj alike, as in Llama."""
        return LlamaAttention.projection_biases(config)

    def __init__(self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(config, layer_index, parallel, backend)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = super().project_qkv(hidden_states)
        return self.q_norm(query), self.k_norm(key), value


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
