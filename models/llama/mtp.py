"""A multi-token-prediction (MTP) layer of DeepSeek-V3's structure, for drafting the token after next.

Row r of a step holds a token t and the hidden state h of the token before it (the target model's
output for the first MTP layer); the layer mixes the two and runs one decoder layer, whose attention
has a KV cache of its own, so that shared_head.norm and the main model's LM head predict the token
that follows t. The embedding and the LM head are the main model's, so the layer costs one decoder
layer and one projection. Checkpoints name its tensors as DeepSeek's released ones do, after the
main layers: `model.layers.{num_hidden_layers + i}.{enorm,hnorm,eh_proj,shared_head.norm}` and the
decoder layer's own names (`...self_attn.q_proj.weight`); `mtp_parameter_name` maps them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from executor.core.types_.forward_metadata import ForwardMetaData
from module.linear import ColumnParallelLinear
from module.norm import RMSNorm

# The tensors of a checkpoint's MTP layer that are the MTP's own; all others belong to its decoder layer.
MTP_OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head")
# DeepSeek's checkpoints carry a copy of the main embedding and LM head in each MTP layer; here they are shared.
MTP_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


class SharedHead(nn.Module):
    """DeepSeek's name for the MTP's output norm; its `head` is the main model's LM head, not kept here."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(nn.Module):
    """enorm(embedding) and hnorm(previous hidden) -> eh_proj -> one decoder layer (+ its residual).

    `mtp_block` is the model's own decoder layer, called as `block(hidden, None, rotary, metadata)`
    and returning `(output, residual)` like the main layers, so the layer is written once for any model.
    """

    def __init__(self, hidden_size: int, eps: float, mtp_block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        # tp_size 1: replicated, since every rank needs all of the mixed hidden state.
        self.eh_proj = ColumnParallelLinear(2 * hidden_size, hidden_size, bias=False)
        self.mtp_block = mtp_block
        self.shared_head = SharedHead(hidden_size, eps)

    def forward(
        self,
        input_embeds: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """[T, hidden] embeddings and previous hidden states -> [T, hidden] before shared_head.norm."""
        mixed = torch.cat([self.enorm(input_embeds), self.hnorm(previous_hidden_states)], dim=-1)
        hidden_states, residual = self.mtp_block(self.eh_proj(mixed), None, rotary, forward_metadata)
        return hidden_states + residual


def num_mtp_layers_of(config: object) -> int:
    """`num_nextn_predict_layers` of an HF config (DeepSeek's key); absent or null means none."""
    value = getattr(config, "num_nextn_predict_layers", None) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json: num_nextn_predict_layers must be a non-negative integer, got {value!r}")
    return value


def mtp_parameter_name(checkpoint_name: str, num_hidden_layers: int) -> str | None:
    """Our name for a checkpoint tensor: `model.layers.{N+i}.X` -> `mtp_layers.{i}.X` (the MTP's own
    modules) or `mtp_layers.{i}.mtp_block.X` (its decoder layer); None for a copy of a shared tensor;
    every other name unchanged."""
    match = _LAYER_NAME.fullmatch(checkpoint_name)
    if match is None or int(match[1]) < num_hidden_layers:
        return checkpoint_name
    index, rest = int(match[1]) - num_hidden_layers, match[2]
    if rest.startswith(MTP_SHARED_COPIES):
        return None
    if rest.split(".")[0] in MTP_OWN_MODULES:
        return f"mtp_layers.{index}.{rest}"
    return f"mtp_layers.{index}.mtp_block.{rest}"
