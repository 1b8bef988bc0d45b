"""Ling 3 (every checkpoint that loads as transformers' BailingHybridForCausalLM) as models/kimi_linear/'s
classes with Ling's gates, rope and names.

- KDA layers (module/kda.py) with a bounded forget gate: lower_bound * sigmoid(exp(A_log) *
  (f_proj(x) + dt_bias)) (kda_safe_gate; otherwise Kimi's -exp(A_log) * softplus(...)), and the
  output gate g_proj(x), one projection each.
- MLA layers (every layer_group_size-th) with interleaved rope and a per-head output gate:
  sigmoid(g_proj(x)) scales each head's output before o_proj.
- MoE as Kimi-Linear's (DeepSeek-V3's routing); dense MLPs in the first first_k_dense_replace layers.
- Checkpoint names: word_embeddings, attention (for self_attn), attention.dense (o_proj), the
  router's expert_bias (e_score_correction_bias). The MTP layers after the decoder (num_mtp_layers)
  are skipped, as transformers skips them: it defines no module to run them.

Parity with transformers: tests/test_bailing_hybrid_parity.py.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from models.deepseek_v3.model import DeepseekV3Model
from models.kimi_linear.model import (
    KimiLinearDecoderLayer,
    KimiLinearForCausalLM,
    KimiLinearModel,
)
from module.kda import KimiDeltaAttention
from module.linear import ColumnParallelLinear
from module.mla import MLAAttention
from module.parallel_group import SINGLE, ParallelGroup
from ops.backend import Backend
from ops.linear_method import LinearMethod

# Ling's checkpoint spelling -> ours (transformers' conversion mapping for bailing_hybrid, in reverse).
CHECKPOINT_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class BailingHybridDeltaAttention(KimiDeltaAttention):
    def build_gates(self, config: PretrainedConfig, tp: ParallelGroup, method: LinearMethod) -> None:
        hidden_size, width = config.hidden_size, config.linear_num_heads * self.head_dim
        self.f_proj = ColumnParallelLinear(hidden_size, width, tp=tp, linear_method=method)
        self.g_proj = ColumnParallelLinear(hidden_size, width, tp=tp, linear_method=method)
        self.safe_gate = config.kda_safe_gate
        self.lower_bound = config.kda_lower_bound

    def forget_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate_input = self.gate_input(self.f_proj(hidden_states))
        if self.safe_gate:
            return self.lower_bound * torch.sigmoid(self.decay_rate() * gate_input)
        return -self.decay_rate() * F.softplus(gate_input)

    def output_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.g_proj(hidden_states)


class BailingHybridMLA(MLAAttention):
    """MLA on interleaved rope pairs, each head's output gated by sigmoid(g_proj(x))."""

    def __init__(self, config: PretrainedConfig, tp: ParallelGroup = SINGLE, *, backend: Backend) -> None:
        super().__init__(config, tp, backend=backend)
        self.g_proj = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads, tp=tp, linear_method=backend.linear_method()
        )

    @staticmethod
    def interleaved_rope(config: PretrainedConfig) -> bool:
        return True

    def gate_output(self, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g_proj(hidden_states).float()).to(output.dtype)
        return output * gate.unsqueeze(-1)


class BailingHybridDecoderLayer(KimiLinearDecoderLayer):
    attention_cls = BailingHybridMLA
    linear_attention_cls = BailingHybridDeltaAttention


class BailingHybridModel(KimiLinearModel):
    decoder_layer_cls = BailingHybridDecoderLayer

    @staticmethod
    def build_rotary(config: PretrainedConfig) -> nn.Module:
        return DeepseekV3Model.build_rotary(config)


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    base_model_cls = BailingHybridModel
    family = "Ling 3 (Bailing hybrid)"
    checkpoint_renames = CHECKPOINT_RENAMES
    mtp_absent_reason = "Ling 3's MTP layers are not built: transformers defines no module to run them"

    def _is_skipped(self, checkpoint_name: str) -> bool:
        """The MTP layers (model.layers.N.. past the decoder), as transformers skips them."""
        layer = LAYER_INDEX.match(checkpoint_name)
        return (layer is not None and int(layer[1]) >= self.config.num_hidden_layers) or super()._is_skipped(
            checkpoint_name
        )
