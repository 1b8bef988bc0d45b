"""DeepSeek-V3's multi-token-prediction (MTP) module, mixed into any model's decoder layer.

Row r of a step holds a token t and the hidden state h of the token before it (the target model's
output for the first MTP layer); the layer norms both, projects their concatenation back to the
hidden size and runs one decoder layer, whose attention has a KV cache of its own, so that
shared_head.norm and the main model's LM head predict the token that follows t. The embedding and
the LM head are the main model's. Checkpoints name the layer as DeepSeek's released ones do, after
the main layers: `model.layers.{num_hidden_layers + i}.{enorm,hnorm,eh_proj,shared_head.norm}` beside
the decoder layer's own names, plus copies of the embedding and LM head that are skipped here.
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from module.linear import ColumnParallelLinear
from module.norm import RMSNorm
from module.parallel_group import ModelParallel
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend

# The MTP layers' copies of the embedding and LM head, which they share with the model.
SHARED_MTP_TENSOR = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


class SharedHead(nn.Module):
    """DeepSeek's name for the MTP's output norm; its `head` is the main model's LM head, not kept here."""

    def __init__(self, hidden_size: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, backend=backend)


if TYPE_CHECKING:

    class DecoderLayer(nn.Module):
        """To the type checker, the decoder layer class the mixin precedes in the MRO (at run time its
        base is object): built from (HF config, layer index, parallel, backend), called as a module."""

        def __init__(self, config: Any, layer_index: int, parallel: ModelParallel, backend: Backend) -> None: ...

else:
    DecoderLayer = object


class MTPLayerMixin(DecoderLayer):
    """Mixed in before a model's decoder layer class (`class XMTPLayer(MTPLayerMixin, XDecoderLayer)`, or
    mtp_layer_class(XDecoderLayer)), so the checkpoint's decoder-layer names map onto it unchanged. The
    decoder layer takes (HF config, layer index, parallel, backend); the config's hidden_size and
    rms_norm_eps size the MTP's own parts."""

    def __init__(self, config: Any, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(config, layer_index, parallel, backend)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        # tp_size 1: replicated, since every rank needs all of the mixed hidden state.
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, bias=False, linear_method=backend.linear_method()
        )
        self.shared_head = SharedHead(config.hidden_size, config.rms_norm_eps, backend)

    def predict(
        self,
        inputs_embeds: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """[T, hidden] embeddings and previous hidden states -> [T, hidden] after the block's residual
        add, before shared_head.norm."""
        mixed = torch.cat((self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)), dim=-1)
        hidden_states, residual = self(self.eh_proj(mixed), None, rotary, forward_metadata)
        return hidden_states + residual


@cache
def mtp_layer_class(decoder_layer_cls: type[nn.Module]) -> type[nn.Module]:
    """The MTP layer of a model whose decoder layer class is `decoder_layer_cls` (one class per decoder class,
    so that a family that subclasses the decoder layer gets its MTP layer without writing one)."""
    return type(f"{decoder_layer_cls.__name__}MTP", (MTPLayerMixin, decoder_layer_cls), {"__module__": __name__})


def num_mtp_layers_of(config: object) -> int:
    """`num_nextn_predict_layers` of an HF config (DeepSeek's key); absent or null means none."""
    value = getattr(config, "num_nextn_predict_layers", None) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json: num_nextn_predict_layers must be a non-negative integer, got {value!r}")
    return value


def mtp_parameter_name(checkpoint_name: str, num_hidden_layers: int) -> str | None:
    """For a model that keeps its MTP layers in `mtp_layers`: `model.layers.{N+i}.X` -> `mtp_layers.{i}.X`;
    None for a copy of a shared tensor; every other name unchanged."""
    if SHARED_MTP_TENSOR.match(checkpoint_name):
        return None
    match = _LAYER_NAME.fullmatch(checkpoint_name)
    if match is None or int(match[1]) < num_hidden_layers:
        return checkpoint_name
    return f"mtp_layers.{int(match[1]) - num_hidden_layers}.{match[2]}"
