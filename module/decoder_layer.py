"""The pre-norm transformer block every model here is built from, with the residual add fused into
the next RMSNorm (ops.add_rms_norm), so (output, residual) pairs flow from layer to layer."""

from __future__ import annotations

import torch
from torch import nn

from executor.types_.model_inputs import ForwardMetaData
from module.norm import RMSNorm


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
