"""Llama (and every checkpoint that loads as transformers' LlamaForCausalLM) on the packed TND path.

Built from module/ layers so that tensor parallelism, the ops dispatch and the paged KV cache come
for free; parity with transformers is checked in tests/test_llama_parity.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn
from transformers import LlamaConfig

import ops
from executor.core.types_.forward_metadata import ForwardMetaData
from executor.model_loader.errors import WeightLoadError
from module.activation import SiluAndMul
from module.attention import Attention
from module.decoder_layer import PreNormDecoderLayer
from module.embedding import ParallelLMHead, VocabParallelEmbedding
from module.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from module.mtp import MTPLayerMixin, mtp_parameter_name, num_mtp_layers_of
from module.norm import RMSNorm
from module.rotary import RotaryEmbedding
from module.weights import ShardId, default_weight_loader


def head_dim_of(config: LlamaConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key, value = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        query, key = ops.apply_rotary(
            query.view(-1, self.num_heads, self.head_dim), key.view(-1, self.num_kv_heads, self.head_dim), *rotary
        )
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        output = self.attn(query, key, value, forward_metadata)
        return self.o_proj(output.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"LlamaMLP supports hidden_act 'silu' only, got {config.hidden_act!r}")
        intermediate = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate, intermediate], bias=config.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate, config.hidden_size, bias=config.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp_rank, tp_size)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, tp_rank, tp_size) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One cos/sin table for all layers, looked up once per step.
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, rotary, forward_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaMTPLayer(MTPLayerMixin, LlamaDecoderLayer):
    """DeepSeek-V3's MTP module (module/mtp.py) on one more Llama decoder layer."""

    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__(config, tp_rank, tp_size)
        self.add_mtp_modules(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (our fused module, shard id passed to its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: LlamaConfig, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp_rank, tp_size)
        if hf_config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # config.num_nextn_predict_layers of them; none (an empty list, no parameters) without the key.
        self.num_mtp_layers = num_mtp_layers_of(hf_config)
        self.mtp_layers = nn.ModuleList(
            [LlamaMTPLayer(hf_config, tp_rank, tp_size) for _ in range(self.num_mtp_layers)]
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """Packed input_ids/positions [T] -> final hidden states [T, hidden] (after the last norm)."""
        return self.model(input_ids, positions, forward_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the rows a step samples; the LM head gathers its vocab shards."""
        return self.lm_head(hidden_states, row_indices)

    def mtp_forward(
        self,
        layer: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """MTP layer `layer` on packed rows -> [T, hidden] before its shared_head.norm. Row r holds
        input_ids[r] and the hidden state of the token before it: for layer 0 the target's forward()
        output (after its final norm), for a later draft the previous mtp_forward output."""
        input_embeds = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary_emb(positions, input_embeds.dtype)
        return self.mtp_layers[layer].predict(input_embeds, previous_hidden_states, rotary, forward_metadata)

    def mtp_compute_logits(self, layer: int, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """shared_head.norm of MTP layer `layer`, then the main LM head, on the rows a step drafts from."""
        return self.lm_head(self.mtp_layers[layer].shared_head.norm(hidden_states), row_indices)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameters that received every shard they need."""
        params = dict(self.named_parameters())
        shards_per_module = Counter(module for module, _ in self.packed_modules_mapping.values())
        received: dict[str, set[ShardId]] = {}
        for checkpoint_name, tensor in weights:
            if "rotary_emb.inv_freq" in checkpoint_name:
                continue
            if checkpoint_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard_id = mtp_parameter_name(checkpoint_name, self.config.num_hidden_layers), None
            if name is None:  # an MTP layer's copy of the embedding or LM head, which are shared here
                continue
            for checkpoint_module, (fused_module, fused_shard) in self.packed_modules_mapping.items():
                if f".{checkpoint_module}." in name:
                    name = name.replace(f".{checkpoint_module}.", f".{fused_module}.")
                    shard_id = fused_shard
                    break
            param = params.get(name)
            if param is None:
                raise WeightLoadError(
                    f"unexpected checkpoint tensor {checkpoint_name!r}: {type(self).__name__} has no parameter {name!r}"
                )
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            except WeightLoadError as error:
                raise WeightLoadError(f"checkpoint tensor {checkpoint_name!r}: {error}") from None
            received.setdefault(name, set()).add(shard_id)
        # name = "<prefix>.<module>.<weight|bias>"; only fused modules need more than one shard.
        return {
            name
            for name, shard_ids in received.items()
            if len(shard_ids) == shards_per_module.get(name.split(".")[-2], 1)
        }
