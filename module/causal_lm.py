"""The decoder-only skeleton every model here is built from: the pre-norm transformer block, with
the residual add fused into the next RMSNorm (ops.add_rms_norm), so (output, residual) pairs flow
from layer to layer; and the causal-LM surface the engine calls (model contract,
docs/adding_a_model.md), written once for every model built as `self.model` (embed_tokens,
rotary_emb, forward) plus `self.lm_head`."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from module.embedding import ParallelLMHead
from module.mtp import MTPLayerMixin, num_mtp_layers_of
from module.norm import RMSNorm
from ops.attention.metadata import ForwardMetaData


class PreNormDecoderLayer(nn.Module):
    """Subclasses build `self_attn` (hidden, rotary, metadata -> hidden) or another token mixer
    (mix_tokens), `mlp`, and the two norms."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.pre_attention(hidden_states, residual)
        hidden_states = self.mix_tokens(hidden_states, rotary, forward_metadata)
        return self.post_attention(hidden_states, residual)

    def pre_attention(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm, with the previous layer's residual added (None in the first layer)."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual)

    def post_attention(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output added to the residual, normed, through the MLP -> (output, residual)."""
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def mix_tokens(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """The layer's token mixer: self-attention; a linear-attention layer of a hybrid model overrides it."""
        return self.self_attn(hidden_states, rotary, forward_metadata)


class CausalLM(nn.Module):
    """Subclasses build `model` and `lm_head` and say where MTP layer i lives (mtp_layer)."""

    model: nn.Module
    lm_head: ParallelLMHead
    num_mtp_layers: int  # mtp_layers_to_build(config), set as the layers are built
    mtp_absent_reason = "config.json num_nextn_predict_layers is 0 or absent"  # why mtp_layers_to_build gave 0

    @classmethod
    def mtp_layers_to_build(cls, config: PretrainedConfig) -> int:
        """How many MTP layers this class builds from HF `config` (none: mtp_absent_reason says why).
        A class method, so that MTP drafting on a model without them is refused before it loads
        (executor/core/spec_decode/mtp.py's check_mtp_layers, from the preflight and the proposer);
        the model builds this many. A ValueError for a config whose MTP keys are unusable."""
        return num_mtp_layers_of(config)

    @classmethod
    def num_checkpoint_layers(cls, config: PretrainedConfig) -> int:
        """How many decoder layers a checkpoint of HF `config` numbers `model.layers.{i}` (MTP layers
        kept after them not counted): what a cut to the first layers (custom_params.num_hidden_layers,
        executor/model_loader/layer_cut.py) counts in."""
        return config.num_hidden_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """Packed input_ids/positions [T] -> final hidden states [T, hidden] (after the last norm)."""
        return self.model(input_ids, positions, forward_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the rows a step samples; the LM head gathers its vocab shards."""
        return self.lm_head(hidden_states, row_indices)

    def mtp_layer(self, layer: int) -> MTPLayerMixin:
        """MTP layer `layer` (IndexError past num_mtp_layers); where a model keeps them is its own choice."""
        raise NotImplementedError

    def mtp_embedding(self, layer: int) -> nn.Module:
        """The embedding MTP layer `layer` reads its tokens through: the model's own, as DeepSeek's
        MTP modules share it; a family whose checkpoints give the MTP its own says so here."""
        return cast(nn.Module, self.model.embed_tokens)

    def mtp_forward(
        self,
        layer: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """MTP layer `layer` on packed input_ids/positions [T] (each row's next token, at the row's
        position) and the previous depth's hidden states [T, hidden] (for layer 0, forward()'s output,
        after the final norm) -> hidden states [T, hidden] before shared_head.norm. Its attention reads
        and writes its own cache through the step's block tables."""
        inputs_embeds = self.mtp_embedding(layer)(input_ids)
        rotary = cast(nn.Module, self.model.rotary_emb)(positions, inputs_embeds.dtype)
        return self.mtp_layer(layer).predict(inputs_embeds, previous_hidden_states, rotary, forward_metadata)

    def mtp_compute_logits(self, layer: int, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """shared_head.norm of MTP layer `layer`, then the shared LM head -> logits [rows, vocab]."""
        return self.lm_head(self.mtp_layer(layer).shared_head.norm(hidden_states), row_indices)
