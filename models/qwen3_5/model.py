"""Qwen3.5 (transformers' qwen3_5 / qwen3_5_moe text models): a hybrid of Gated DeltaNet linear
attention (module/gated_delta_net.py, a recurrent state per request) and gated full attention, on
Qwen3's classes.

What differs from Qwen3, each through a hook of the Llama / Qwen3 classes:
- `layer_types` picks each layer's token mixer: `linear_attention` layers hold a GatedDeltaNet named
  `linear_attn` (its state in a recurrent cache group), `full_attention` layers Qwen3's attention;
- the full attention is gated: q_proj gives each head its query and an output gate (twice the
  width, per head), the output is multiplied by sigmoid(gate) before o_proj; rope covers the first
  partial_rotary_factor of each head only;
- every RMSNorm but the DeltaNet's output norm is zero-centred in the checkpoint (the norm multiplies
  by 1 + w): those weights load as 1 + w;
- the MoE variant (models/qwen3_5_moe) has a shared expert scaled by a sigmoid gate of its own beside
  softmax top-k routing (always renormalised).

Checkpoints of the multimodal model name the text model `model.language_model.*`: it loads as
`model.*`, its vision tower (`model.visual.*`) is skipped. Parity with transformers:
tests/test_qwen3_5_parity.py.

MTP (config mtp_num_hidden_layers, 1 in the released models; the checkpoints' `mtp.*`): module/mtp.py's
module, named otherwise (MTP_RENAMES): pre_fc_norm_embedding and pre_fc_norm_hidden (zero-centred,
as every norm here) over the embedding and the main model's final hidden state, fc over their
concatenation (embedding first), one full-attention decoder layer of the model's kind (`mtp.layers.0`)
and the closing norm `mtp.norm`; the embedding and LM head are the main model's. transformers skips
`mtp.*`; tests/test_qwen3_5_mtp.py checks the module against a direct reference.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from executor.types_.checkpoint_tensor import materialize
from executor.types_.errors import WeightLoadError
from models.llama.model import LlamaModel, head_dim_of
from models.qwen3.model import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM
from module.gated_delta_net import GatedDeltaNet
from module.linear import QKVParallelLinear
from module.parallel_group import SINGLE, ModelParallel, ParallelGroup
from module.rotary import RotaryEmbedding
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.linear_method import LinearMethod

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# checkpoint prefixes of the multimodal model's parts this text model does not hold
SKIPPED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
# (checkpoint name pattern, ours): the MTP module's parts as Qwen's checkpoints name them -> module/mtp.py's
MTP_RENAMES = (
    (re.compile(r"^mtp\.pre_fc_norm_embedding\."), "mtp_layers.0.enorm."),
    (re.compile(r"^mtp\.pre_fc_norm_hidden\."), "mtp_layers.0.hnorm."),
    (re.compile(r"^mtp\.fc\."), "mtp_layers.0.eh_proj."),
    (re.compile(r"^mtp\.norm\."), "mtp_layers.0.shared_head.norm."),
    (re.compile(r"^mtp\.layers\.0\."), "mtp_layers.0."),
)


class Qwen3_5Attention(Qwen3Attention):
    """Gated attention: q_proj's output per head is [query, gate]; partial rope; q/k norms."""

    def build_qkv_proj(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, bias: bool, method: LinearMethod
    ) -> QKVParallelLinear:
        """Twice the query heads: each head's query and then its gate, as q_proj lays them out."""
        return QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
            tp=parallel.attn_tp,
            linear_method=method,
        )

    def forward(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_size, kv_size = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query_gate, key, value = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        query, gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query.contiguous())
        key = self.k_norm(key.view(num_tokens, self.num_kv_heads, self.head_dim))
        query, key = self.apply_partial_rotary(query, key, rotary)
        output = self.attn(query, key, value.view(num_tokens, self.num_kv_heads, self.head_dim), forward_metadata)
        output = output.flatten(1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(output)

    def apply_partial_rotary(
        self, query: torch.Tensor, key: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope on each head's first rotary_dim dims (cos/sin's width), the rest passed through."""
        rotary_dim = rotary[0].shape[-1]
        query_rot, key_rot = self.ops.apply_rotary(
            query[..., :rotary_dim].contiguous(), key[..., :rotary_dim].contiguous(), *rotary
        )
        return (
            torch.cat([query_rot, query[..., rotary_dim:]], dim=-1),
            torch.cat([key_rot, key[..., rotary_dim:]], dim=-1),
        )


def build_gated_delta_net(
    config: PretrainedConfig,
    backend: Backend,
    layer_cls: type[GatedDeltaNet] = GatedDeltaNet,
    tp: ParallelGroup = SINGLE,
) -> GatedDeltaNet:
    return layer_cls(
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        config.rms_norm_eps,
        config.hidden_act,
        tp,
        backend=backend,
    )


class Qwen3_5DecoderLayer(Qwen3DecoderLayer):
    attention_cls = Qwen3_5Attention
    linear_attention_cls: type[GatedDeltaNet] = GatedDeltaNet

    def build_token_mixer(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> None:
        """`linear_attn` (Gated DeltaNet) in linear_attention layers, gated `self_attn` in the others."""
        self.is_linear = config.layer_types[layer_index] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = build_gated_delta_net(config, backend, self.linear_attention_cls, parallel.attn_tp)
        else:
            super().build_token_mixer(config, layer_index, parallel, backend)

    def mix_tokens(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        if self.is_linear:
            return self.linear_attn(hidden_states, forward_metadata)
        return self.self_attn(hidden_states, rotary, forward_metadata)


class Qwen3_5Model(LlamaModel):
    @staticmethod
    def build_rotary(config: PretrainedConfig) -> RotaryEmbedding:
        """Rope over the first partial_rotary_factor of each head (a quarter in the released models)."""
        return RotaryEmbedding(config, head_dim_of(config), partial=True)


def is_zero_centred_norm(name: str) -> bool:
    """Qwen3.5's RMSNorm weights are stored as w for a norm by 1 + w; the DeltaNet's gated output norm
    (linear_attn.norm) multiplies by its weight as it is."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def mtp_checkpoint_name(checkpoint_name: str) -> str:
    """`mtp.*` as Qwen's checkpoints name the MTP module -> our `mtp_layers.0.*`; other names unchanged."""
    for pattern, name in MTP_RENAMES:
        if pattern.match(checkpoint_name):
            return pattern.sub(name, checkpoint_name, count=1)
    if checkpoint_name.startswith(MTP_PREFIX):
        raise WeightLoadError(f"checkpoint tensor {checkpoint_name!r}: not a part of Qwen's one MTP layer")
    return checkpoint_name


class Qwen3_5ForCausalLM(Qwen3ForCausalLM):
    decoder_layer_cls = Qwen3_5DecoderLayer
    base_model_cls = Qwen3_5Model
    mtp_absent_reason = "config.json mtp_num_hidden_layers is 0 or absent"

    @staticmethod
    def mtp_layers_to_build(config: PretrainedConfig) -> int:
        """mtp_num_hidden_layers (Qwen's key): 0 or 1, since the checkpoints hold one fc and one set of
        norms for the MTP, which module/mtp.py keeps per layer."""
        value = getattr(config, "mtp_num_hidden_layers", None) or 0
        if isinstance(value, bool) or value not in (0, 1):
            raise ValueError(f"config.json: mtp_num_hidden_layers must be 0 or 1 (Qwen's one MTP layer), got {value!r}")
        return value

    @staticmethod
    def mtp_layer_index(config: PretrainedConfig) -> int:
        """The last full-attention layer: the MTP layer is full attention with the model's MLP."""
        full = [index for index, kind in enumerate(config.layer_types) if kind == FULL_ATTENTION]
        if not full:
            raise ValueError("config.json layer_types: the MTP layer is built as a full_attention layer; there is none")
        return full[-1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text model's tensors, named as transformers' text model names them, and the MTP
        module's (`mtp.*`, skipped as transformers skips them where mtp_num_hidden_layers is 0)."""
        return super().load_weights(
            (mtp_checkpoint_name(name.replace("model.language_model.", "model.", 1)), tensor)
            for name, tensor in weights
            if not name.startswith(SKIPPED_PREFIXES) and (self.num_mtp_layers or not name.startswith(MTP_PREFIX))
        )

    def _load_tensor(
        self, checkpoint_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, Hashable]:
        if is_zero_centred_norm(checkpoint_name):
            tensor = materialize(tensor).float() + 1.0
        return super()._load_tensor(checkpoint_name, tensor, params)
