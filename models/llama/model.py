"""Llama (and every checkpoint that loads as transformers' LlamaForCausalLM) on the packed TND path.

Built from module/ layers so that tensor parallelism (over the groups in ModelParallel), the backend's ops
and the paged KV cache come for free; parity with transformers is checked in tests/test_llama_parity.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from executor.types_.errors import WeightLoadError
from module.attention import Attention
from module.causal_lm import CausalLM, PreNormDecoderLayer
from module.embedding import ParallelLMHead, VocabParallelEmbedding
from module.linear import QKVParallelLinear, RowParallelLinear, divide
from module.mlp import GatedMLP
from module.mtp import MTPLayerMixin, mtp_layer_class, mtp_parameter_name
from module.norm import RMSNorm
from module.parallel_group import ONE_PROCESS, ModelParallel
from module.rotary import RotaryEmbedding
from module.weights import fused_shards_needed, load_fused_tensor
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.linear_method import LinearMethod


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """GQA attention with rope. Subclasses change what differs through the hooks: the projections'
    biases, which projections a layer has (projected_parts), a layer's sliding window, the attention
    op's layer (build_attention) and its scale, q/k/v before rope (project_qkv), the rope itself
    (rotate), and the heads' output before o_proj (attend)."""

    def __init__(self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.ops = backend
        method = backend.linear_method()
        qkv_bias, output_bias = self.projection_biases(config)
        self.head_dim = head_dim_of(config)
        self.qkv_proj = self.build_qkv_proj(config, layer_index, parallel, qkv_bias, method)
        self.num_heads = divide(config.num_attention_heads, parallel.attn_tp.size)
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=output_bias,
            tp=parallel.attn_tp,
            linear_method=method,
        )
        self.attn = self.build_attention(config, self.layer_sliding_window(config, layer_index), parallel)

    def build_qkv_proj(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, bias: bool, method: LinearMethod
    ) -> QKVParallelLinear:
        """The fused projection of the parts the layer has (projected_parts) over this rank's heads
        (gated attention widens its q part)."""
        return QKVParallelLinear(
            self.qkv_input_size(config),
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
            tp=parallel.attn_tp,
            linear_method=method,
            parts=self.projected_parts(config, layer_index),
        )

    def qkv_input_size(self, config: PretrainedConfig) -> int:
        """What q/k/v project from: the hidden state (EAGLE-3's drafter reads two of them side by side)."""
        return config.hidden_size

    def build_attention(
        self, config: PretrainedConfig, sliding_window: int | None, parallel: ModelParallel
    ) -> Attention:
        """The paged attention over this rank's heads (after the projections are built)."""
        return Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.attention_scale(config),
            sliding_window=sliding_window,
            backend=self.ops,
        )

    def attention_scale(self, config: PretrainedConfig) -> float:
        """The softmax scale: 1/sqrt(head_dim)."""
        return self.head_dim**-0.5

    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): Llama's attention_bias sets both."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def projected_parts(config: PretrainedConfig, layer_index: int) -> str:
        """Which of q, k, v the layer projects (QKVParallelLinear's parts): all three in Llama."""
        return "qkv"

    @staticmethod
    def layer_sliding_window(config: PretrainedConfig, layer_index: int) -> int | None:
        """The layer's attention window; Llama attends over the whole sequence in every layer."""
        return None

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> query [T, H, D], key and value [T, Hkv, D], before rope."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key, value = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        return (
            query.view(-1, self.num_heads, self.head_dim),
            key.view(-1, self.num_kv_heads, self.head_dim),
            value.view(-1, self.num_kv_heads, self.head_dim),
        )

    def rotate(
        self, query: torch.Tensor, key: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope on query [T, H, D] and key [T, Hkv, D] by the step's (cos, sin) [T, D]."""
        return self.ops.apply_rotary(query, key, *rotary)

    def attend(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """hidden [T, hidden] -> the attention's output per head [T, H, D], before o_proj."""
        query, key, value = self.project_qkv(hidden_states)
        query, key = self.rotate(query, key, rotary)
        return self.attn(query, key, value, forward_metadata)

    def forward(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        return self.o_proj(self.attend(hidden_states, rotary, forward_metadata).flatten(1))


class LlamaDecoderLayer(PreNormDecoderLayer):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.build_token_mixer(config, layer_index, parallel, backend)
        self.mlp = self.build_mlp(config, layer_index, parallel, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)

    def build_token_mixer(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> None:
        """The layer's token mixer under the checkpoint's name for it: `self_attn` (attention_cls)
        here; a hybrid model builds a linear-attention layer instead in some layers."""
        self.self_attn = self.attention_cls(config, layer_index, parallel, backend)

    def build_mlp(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """The layer's feed-forward block: Llama's is a SwiGLU MLP with optional biases in every layer."""
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=config.mlp_bias,
            tp=parallel.dense_tp,
            backend=backend,
        )


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        parallel: ModelParallel,
        decoder_layer_cls: type[LlamaDecoderLayer],
        backend: Backend,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.embed_tp)
        self.layers = nn.ModuleList(
            [decoder_layer_cls(config, index, parallel, backend) for index in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.rotary_emb = self.build_rotary(config)

    def build_rotary(self, config: PretrainedConfig) -> nn.Module:
        """(positions [T], dtype) -> what every layer's attention rotates by: here one cos/sin table
        over the whole head for all layers, looked up once per step (a model with partial rope or a
        table per layer type says so)."""
        return RotaryEmbedding(config, head_dim_of(config))

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


class LlamaForCausalLM(CausalLM):
    """The causal LM over LlamaModel. Families that differ only in their layers set decoder_layer_cls,
    those whose layer stack differs (embedding, rope tables, what flows between layers) base_model_cls;
    loading goes one checkpoint tensor at a time through _load_tensor, which they may extend."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    base_model_cls: type[LlamaModel] = LlamaModel
    # checkpoint module name -> (our fused module, shard id passed to its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: PretrainedConfig, *, parallel: ModelParallel = ONE_PROCESS, backend: Backend) -> None:
        super().__init__()
        self.config = hf_config
        self.model = self.base_model_cls(hf_config, parallel, self.decoder_layer_cls, backend)
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size, hf_config.hidden_size, parallel.lmhead_tp, backend.linear_method()
        )
        if hf_config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # mtp_layers_to_build(config) of them; none is an empty list, no parameters.
        self.num_mtp_layers = self.mtp_layers_to_build(hf_config)
        self.mtp_layers = nn.ModuleList(
            [
                mtp_layer_class(self.decoder_layer_cls)(hf_config, self.mtp_layer_index(hf_config), parallel, backend)
                for _ in range(self.num_mtp_layers)
            ]
        )

    @staticmethod
    def mtp_layer_index(config: PretrainedConfig) -> int:
        """The decoder layer whose kind (token mixer, MLP) the MTP layers are built as: the last one."""
        return config.num_hidden_layers - 1

    def mtp_layer(self, layer: int) -> MTPLayerMixin:
        if not 0 <= layer < self.num_mtp_layers:
            raise IndexError(f"MTP layer {layer} does not exist: the model has {self.num_mtp_layers}")
        return self.mtp_layers[layer]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameters that received every shard they need."""
        params = dict(self.named_parameters())
        received: dict[str, set[Hashable]] = {}
        for checkpoint_name, tensor in weights:
            if "rotary_emb.inv_freq" in checkpoint_name:
                continue
            if checkpoint_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name = mtp_parameter_name(checkpoint_name, self.config.num_hidden_layers)
            if name is None:  # an MTP layer's copy of the embedding or LM head, which are shared here
                continue
            try:
                name, shard = self._load_tensor(name, tensor, params)
            except WeightLoadError as error:
                raise WeightLoadError(f"checkpoint tensor {checkpoint_name!r}: {error}") from None
            received.setdefault(name, set()).add(shard)
        return {name for name, shards in received.items() if len(shards) == self._shards_needed(name)}

    def _load_tensor(
        self, checkpoint_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, Hashable]:
        """Copy one checkpoint tensor into its parameter; -> (parameter name, which shard it was)."""
        return load_fused_tensor(self, checkpoint_name, tensor, params, self.packed_modules_mapping)

    def _shards_needed(self, name: str) -> int:
        """How many checkpoint tensors fill parameter `name`: one per part for a fused module."""
        return fused_shards_needed(name, self.packed_modules_mapping)
