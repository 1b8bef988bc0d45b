"""Kimi-Linear (every checkpoint that loads as transformers' KimiLinearForCausalLM) as models/deepseek_v3/'s
classes, with KDA linear-attention layers between the MLA ones.

- Attention: config.layer_types says per layer: "linear_attention" is Kimi Delta Attention
  (module/kda.py: per-request conv and recurrent states in state slots), "full_attention" is MLA
  without rope (NoPE: the qk_rope_head_dim part of the key is still the one shared key, unrotated;
  softmax scale qk_head_dim^-1/2).
- KDA's forget gate: -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias), per channel; its output
  gate g_b_proj(g_a_proj(x)).
- Feed-forward: config.mlp_layer_types says per layer: "dense" (an MLP) or "sparse" (DeepSeek-V3's
  MoE: sigmoid routing with the score-correction bias, grouped top-k, shared experts).
- Checkpoint names: block_sparse_moe for mlp, experts' w1 / w3 / w2 for gate / up / down, q/k/v
  convolutions stacked into one weight. No MTP modules.

Parity with transformers: tests/test_kimi_linear_parity.py.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import KimiLinearConfig, PretrainedConfig

from models.deepseek_v3.model import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model, DeepseekV3MoE
from module.kda import KimiDeltaAttention
from module.linear import ColumnParallelLinear
from module.mla import MLAAttention
from module.parallel_group import ModelParallel, ParallelGroup
from ops.backend import Backend
from ops.linear_method import LinearMethod

# Kimi's checkpoint spelling -> ours (transformers' conversion mapping for kimi_linear, in reverse).
CHECKPOINT_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
)
CONV_SHARDS = {"q_conv1d": ("conv1d", 0), "k_conv1d": ("conv1d", 1), "v_conv1d": ("conv1d", 2)}


class KimiLinearDeltaAttention(KimiDeltaAttention):
    def build_gates(self, config: PretrainedConfig, tp: ParallelGroup, method: LinearMethod) -> None:
        """Low-rank gates through head_dim: the down-projections replicated, the up-projections by head."""
        hidden_size, width = config.hidden_size, config.linear_num_heads * self.head_dim
        self.f_a_proj = ColumnParallelLinear(hidden_size, self.head_dim, linear_method=method)
        self.f_b_proj = ColumnParallelLinear(self.head_dim, width, tp=tp, linear_method=method)
        self.g_a_proj = ColumnParallelLinear(hidden_size, self.head_dim, linear_method=method)
        self.g_b_proj = ColumnParallelLinear(self.head_dim, width, tp=tp, linear_method=method)

    def forget_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return -self.decay_rate() * F.softplus(self.gate_input(self.f_b_proj(self.f_a_proj(hidden_states))))

    def output_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(hidden_states))


class KimiLinearMLA(MLAAttention):
    """MLA with no positional rotation (transformers' KimiLinearAttention)."""

    @staticmethod
    def interleaved_rope(config: PretrainedConfig) -> bool:
        return False

    @staticmethod
    def softmax_scale(config: PretrainedConfig, qk_head_dim: int) -> float:
        return qk_head_dim**-0.5

    def rotate(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, rotary: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q_pe, k_pe


class NoRotary(nn.Module):
    """A model without rope looks up nothing per step; its layers get an empty tuple."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return ()


class KimiLinearMoE(DeepseekV3MoE):
    @staticmethod
    def num_routed_experts(config: PretrainedConfig) -> int:
        return config.num_local_experts


class KimiLinearDecoderLayer(DeepseekV3DecoderLayer):
    attention_cls = KimiLinearMLA
    linear_attention_cls: type[KimiDeltaAttention] = KimiLinearDeltaAttention
    moe_cls = KimiLinearMoE

    def build_attention(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        if config.layer_types[layer_index] == "linear_attention":
            return self.linear_attention_cls(config, parallel.attn_tp, backend=backend)
        return super().build_attention(config, layer_index, parallel, backend)

    @staticmethod
    def is_moe_layer(config: PretrainedConfig, layer_index: int) -> bool:
        return config.mlp_layer_types[layer_index] == "sparse"


class KimiLinearModel(DeepseekV3Model):
    decoder_layer_cls = KimiLinearDecoderLayer

    @staticmethod
    def build_rotary(config: PretrainedConfig) -> nn.Module:
        return NoRotary()

    @staticmethod
    def num_mtp_layers(config: PretrainedConfig) -> int:
        return 0


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    packed_modules_mapping = {**DeepseekV3ForCausalLM.packed_modules_mapping, **CONV_SHARDS}
    base_model_cls = KimiLinearModel
    family = "Kimi-Linear"
    checkpoint_renames: tuple[tuple[re.Pattern, str], ...] = CHECKPOINT_RENAMES
    mtp_absent_reason = "Kimi-Linear has no MTP modules (transformers' kimi_linear defines none)"

    @staticmethod
    def ties_word_embeddings(config: PretrainedConfig) -> bool:
        """Never: transformers' class keeps its own LM head whatever tie_word_embeddings says."""
        return False

    @staticmethod
    def check_config(config: KimiLinearConfig) -> None:
        """Refuse a layer or MLP type transformers' KimiLinearForCausalLM would not build either."""
        for key, value, built in (
            ("layer_types", config.layer_types, ("linear_attention", "full_attention")),
            ("mlp_layer_types", config.mlp_layer_types, ("dense", "sparse")),
        ):
            unknown = sorted(set(value) - set(built))
            if unknown:
                raise ValueError(f"config {key} holds {unknown}: {' and '.join(built)} only are built")

    def checkpoint_name(self, name: str) -> str:
        for pattern, replacement in self.checkpoint_renames:
            name = pattern.sub(replacement, name)
        return name
