"""DeepSeek-V3.2 (every checkpoint that loads as transformers' DeepseekV32ForCausalLM: DeepSeek-V3.2-Exp,
V3.2) as models/deepseek_v3/'s classes with DeepSeek sparse attention (module/dsa.py) in every layer.

- Attention: MLA over the index_topk tokens a lightning indexer selects per query; the indexer's
  key is a second tensor of the layer's cache (`index_key`, beside the latent). Its rope takes the
  first qk_rope_head_dim dims as half-split pairs; MLA's own rope is always interleaved.
- Dense or MoE per layer by mlp_layer_types (first_k_dense_replace derives it); MoE, routing, MTP
  modules (which carry an indexer of their own) and the loading of DeepSeek's names are V3's.
- q LoRA always (transformers' config takes no null q_lora_rank): the indexer's queries come
  from its normed latent.

Parity with transformers: tests/test_dsa_parity.py, MTP tests/test_dsa_mtp.py. GLM-5 (models/glm_5) subclasses this.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV32Config

from models.deepseek_v3.model import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model
from module.dsa import SparseMLAAttention
from module.mtp import MTPLayerMixin
from module.parallel_group import ModelParallel
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    self_attn: SparseMLAAttention

    def build_attention(
        self, config: DeepseekV32Config, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> SparseMLAAttention:
        return SparseMLAAttention(
            config,
            parallel.attn_tp,
            has_indexer=self.runs_indexer(config, layer_index),
            interleaved_indexer_rope=self.interleaved_indexer_rope(config),
            backend=backend,
        )

    @staticmethod
    def runs_indexer(config: DeepseekV32Config, layer_index: int) -> bool:
        """Whether the layer selects with an indexer of its own (every DeepSeek-V3.2 layer does)."""
        return True

    @staticmethod
    def interleaved_indexer_rope(config: DeepseekV32Config) -> bool:
        return False

    @staticmethod
    def is_moe_layer(config: DeepseekV32Config, layer_index: int) -> bool:
        """mlp_layer_types' "sparse" layers; past them (the MTP layers) as V3 decides."""
        if layer_index < len(config.mlp_layer_types):
            return config.mlp_layer_types[layer_index] == "sparse"
        return DeepseekV3DecoderLayer.is_moe_layer(config, layer_index)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual, _ = self.forward_with_selection(
            hidden_states, residual, rotary, forward_metadata, None
        )
        return hidden_states, residual

    def forward_with_selection(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
        selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pre-norm block, taking the previous layer's selection and giving this layer's."""
        hidden_states, residual = self.pre_attention(hidden_states, residual)
        hidden_states, selection = self.self_attn.forward_with_selection(
            hidden_states, rotary, forward_metadata, selection
        )
        return (*self.post_attention(hidden_states, residual), selection)


class DeepseekV32MTPLayer(MTPLayerMixin, DeepseekV32DecoderLayer):
    """One MTP module (module/mtp.py) on a DSA decoder layer; as a layer past num_hidden_layers it
    runs an indexer of its own."""


class DeepseekV32Model(DeepseekV3Model):
    decoder_layer_cls = DeepseekV32DecoderLayer
    mtp_layer_cls = DeepseekV32MTPLayer

    def run_layers(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers in turn, each handed the selection of the one before (GLM-5's shared layers use it)."""
        residual = selection = None
        for layer in self.layers[: self.num_hidden_layers]:
            hidden_states, residual, selection = layer.forward_with_selection(
                hidden_states, residual, rotary, forward_metadata, selection
            )
        return hidden_states, residual


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    base_model_cls = DeepseekV32Model
    family = "DeepSeek-V3.2"
