"""Gemma 4's text model (transformers' Gemma4ForCausalLM, or the language model of a
Gemma4ForConditionalGeneration checkpoint, whose vision and audio towers are not read) on Llama's
skeleton, with what Gemma 4 changes:

- the token embedding times sqrt(hidden_size) (in the model's dtype, as transformers rounds it);
- per-layer head dims and KV heads (`config.per_layer_config`: full-attention layers have
  global_head_dim, and num_global_key_value_heads where attention_k_eq_v), q/k RMSNorms with
  weights and an unweighted v RMSNorm, attention scale 1 (the norms set the logits' size);
- full layers with attention_k_eq_v project no v: the values are the keys' projection before
  k_norm and rope, through v_norm (QKVParallelLinear parts "qk");
- a sliding window on the layers `layer_types` marks sliding, a cache group of their own, and a
  rope table per layer type (sliding: default rope; full: proportional rope, whose zero
  frequencies leave the last (1 - partial_rotary_factor) of each half unrotated);
- the last num_kv_shared_layers layers project only q and attend over the K/V of the last earlier
  layer of their type (module.attention.SharedKVAttention: no cache of their own), with a
  double-wide MLP where use_double_wide_mlp;
- sandwich norms (after attention, before and after the feed-forward), and with enable_moe_block
  a routed GeGLU MoE beside the dense GeGLU MLP, the two outputs each normed and summed;
- per-layer inputs (PLE): a second embedding table and a projection of the embeddings give each
  layer a vector that gates a residual branch after its feed-forward;
- each layer's output times its layer_scalar, and the final logits soft-capped
  (cap * tanh(logits / cap)) where final_logit_softcapping is set.

Parity with transformers: tests/test_gemma4_parity.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma4TextConfig

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import LinearScheme
from models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from module.attention import Attention, SharedKVAttention
from module.embedding import VocabParallelEmbedding
from module.linear import ColumnParallelLinear
from module.mlp import GatedMLP
from module.moe import FusedExperts, Router
from module.mtp import num_mtp_layers_of
from module.norm import RMSNorm
from module.parallel_group import ONE_PROCESS, SINGLE, ModelParallel, ParallelGroup
from module.quantized import QuantizationError
from module.rotary import RotaryEmbedding
from module.weights import ShardId
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.linear_method import PLAIN

LAYER_TYPES = ("sliding_attention", "full_attention")
HIDDEN_ACTIVATION = "gelu_pytorch_tanh"
# Tensors of a multimodal checkpoint that the text model does not read.
MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
LANGUAGE_MODEL_PREFIX = "model.language_model."
# What transformers drops from a KV-shared layer's checkpoint entries (_keys_to_ignore_on_load_unexpected).
SHARED_LAYER_UNUSED = ("k_proj", "v_proj", "k_norm", "v_norm")


class UnscaledRMSNorm(nn.Module):
    """RMSNorm without a learned scale (Gemma 4's v_norm and router norm): the backend's op over a
    ones weight that no checkpoint holds (a buffer, not a parameter)."""

    def __init__(self, hidden_size: int, eps: float, *, backend: Backend) -> None:
        super().__init__()
        self.eps = eps
        self.ops = backend
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def reads_shared_kv(config: Gemma4TextConfig, layer_index: int) -> bool:
    return config.kv_sharing_modes[layer_index] == "reuse"


class Gemma4Attention(LlamaAttention):
    """Llama's attention built from the layer's own config (per_layer_config: its head_dim and KV
    heads), with q/k/v norms, scale 1, the window of its type, and K/V of its own or (a KV-shared
    layer) those of the last earlier layer of its type, passed along in `shared_kv`."""

    def __init__(self, config: Gemma4TextConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(config.per_layer_config[layer_index], layer_index, parallel, backend)
        self.layer_type = config.layer_types[layer_index]
        self.stores_shared_kv = config.kv_sharing_modes[layer_index] == "store"
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)
        if not self.reads_shared_kv:
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)
            self.v_norm = UnscaledRMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)

    @property
    def reads_shared_kv(self) -> bool:
        return self.qkv_proj.parts == "q"

    @staticmethod
    def projected_parts(config: Gemma4TextConfig, layer_index: int) -> str:
        if reads_shared_kv(config, layer_index):
            return "q"
        if config.attention_k_eq_v and config.layer_types[layer_index] == "full_attention":
            return "qk"
        return "qkv"

    @staticmethod
    def layer_sliding_window(config: Gemma4TextConfig, layer_index: int) -> int | None:
        return config.sliding_window if config.layer_types[layer_index] == "sliding_attention" else None

    def build_attention(
        self, config: Gemma4TextConfig, sliding_window: int | None, parallel: ModelParallel
    ) -> Attention | SharedKVAttention:
        if self.reads_shared_kv:  # the model links it to its source layer's Attention
            return SharedKVAttention(
                self.num_heads, self.head_dim, scale=1.0, sliding_window=sliding_window, backend=self.ops
            )
        return Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=1.0, sliding_window=sliding_window, backend=self.ops
        )

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed query [T, H, D], key and value [T, Hkv, D] before rope; value from the key's
        projection where the layer projects no v."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size][: len(self.qkv_proj.parts)], dim=-1)
        query = parts[0].view(-1, self.num_heads, self.head_dim)
        key = parts[1].view(-1, self.num_kv_heads, self.head_dim)
        value = parts[2].view(-1, self.num_kv_heads, self.head_dim) if len(parts) == 3 else key
        return self.q_norm(query), self.k_norm(key), self.v_norm(value)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        forward_metadata: ForwardMetaData,
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """`shared_kv` maps a layer type to this step's K/V of the layer whose cache its KV-shared
        layers read: a storing layer puts its own there, a KV-shared layer takes them."""
        if self.reads_shared_kv:
            query = self.q_norm(self.qkv_proj(hidden_states).view(-1, self.num_heads, self.head_dim))
            # apply_rotary rotates a query and a key (in place on the CPU); a one-head copy stands in for the key.
            query, _ = self.ops.apply_rotary(query, query[:, :1].clone(), *rotary)
            key, value = shared_kv[self.layer_type]
        else:
            query, key, value = self.project_qkv(hidden_states)
            query, key = self.ops.apply_rotary(query, key, *rotary)
            if self.stores_shared_kv:
                shared_kv[self.layer_type] = (key, value)
        output = self.attn(query, key, value, forward_metadata)
        return self.o_proj(output.flatten(1))


class Gemma4Router(Router):
    """Gemma 4's gate, op for op as transformers' Gemma4TextRouter (so ties break the same way):
    unweighted RMSNorm of the hidden state, times `scale` and hidden_size^-0.5, a linear to one
    score per expert, softmax in fp32, top-k, the k weights renormalised to sum 1, each times its
    expert's per_expert_scale. Every rank holds it whole."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float, *, backend: Backend) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"router: top_k_experts {top_k} must be in [1, num_experts {num_experts}]")
        self.top_k = top_k
        self.scalar_root_size = hidden_size**-0.5
        self.norm = UnscaledRMSNorm(hidden_size, eps, backend=backend)
        self.proj = ColumnParallelLinear(hidden_size, num_experts, tp=SINGLE, linear_method=PLAIN)
        self.scale = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = self.norm(hidden_states) * self.scale * self.scalar_root_size
        probabilities = F.softmax(self.proj(hidden_states), dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probabilities, k=self.top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights * self.per_expert_scale[topk_ids], topk_ids


class Gemma4Experts(FusedExperts):
    """FusedExperts' stacked layout run as GeGLU experts. Checkpoints hold it already stacked,
    gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]; the loaders put each
    of this rank's experts in place through FusedExperts.load_expert_weight."""

    NEEDED_OPS = ("moe_experts_gelu_tanh",)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: ParallelGroup,
        ep: ParallelGroup,
        *,
        backend: Backend,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, tp, ep, backend=backend)
        self.intermediate_size = intermediate_size
        self.gate_up_proj.weight_loader = self.load_gate_up_proj
        self.down_proj.weight_loader = self.load_down_proj

    def _local_experts(self, stacked: LoadedWeight) -> Iterator[tuple[int, torch.Tensor]]:
        """(expert id, its tensor) for this EP rank's experts, read one at a time."""
        if stacked.ndim != 3 or stacked.shape[0] != self.num_experts:
            raise WeightLoadError(f"expected {self.num_experts} stacked experts, got shape {tuple(stacked.shape)}")
        for expert in range(self.first_expert, self.first_expert + self.num_local_experts):
            yield expert, materialize(stacked.narrow(0, expert, 1))[0]

    def load_gate_up_proj(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        for expert, weight in self._local_experts(loaded_weight):  # weight [2I, H]
            gate, up = weight.split(self.intermediate_size)
            self.load_expert_weight(gate, expert, "gate_proj")
            self.load_expert_weight(up, expert, "up_proj")

    def load_down_proj(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        for expert, weight in self._local_experts(loaded_weight):  # weight [H, I]
            self.load_expert_weight(weight, expert, "down_proj")

    def checkpoint_modules(self, name: str) -> list[tuple[str, str]]:
        """Gemma 4 checkpoints stack the experts in one module (no per-expert Linear to target)."""
        return [(name, "Gemma4TextExperts")]

    def set_scheme(self, scheme: LinearScheme, method: object, compute_dtype: torch.dtype, at_load: bool) -> None:
        raise QuantizationError(
            f"Gemma 4's stacked experts are not quantized here ({scheme.describe()}); "
            "add the experts to the ignore list"
        )

    def run_dense_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.ops.moe_experts_gelu_tanh(hidden_states, topk_weights, topk_ids, self.gate_up_proj, self.down_proj)


class Gemma4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Gemma 4's sandwich norms, the MoE beside the MLP (enable_moe_block), the
    per-layer input's gated branch (hidden_size_per_layer_input) and the layer_scalar. It returns
    the whole hidden state: the norms after each block leave no residual add to fuse into the next."""

    attention_cls = Gemma4Attention

    def __init__(self, config: Gemma4TextConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(config, layer_index, parallel, backend)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, backend=backend)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, backend=backend)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)
        self.enable_moe_block = config.enable_moe_block
        if self.enable_moe_block:
            self.router = Gemma4Router(hidden, config.num_experts, config.top_k_experts, eps, backend=backend)
            self.experts = Gemma4Experts(
                config.num_experts,
                hidden,
                config.moe_intermediate_size,
                parallel.moe_tp,
                parallel.moe_ep,
                backend=backend,
            )
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, backend=backend)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, backend=backend)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, backend=backend)
        self.has_per_layer_input = bool(config.hidden_size_per_layer_input)
        if self.has_per_layer_input:
            per_layer = config.hidden_size_per_layer_input
            self.per_layer_input_gate = ColumnParallelLinear(hidden, per_layer, linear_method=backend.linear_method())
            self.per_layer_projection = ColumnParallelLinear(per_layer, hidden, linear_method=backend.linear_method())
            self.post_per_layer_input_norm = RMSNorm(hidden, eps, backend=backend)

    def build_mlp(
        self, config: Gemma4TextConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """A GeGLU MLP in every layer, twice as wide in KV-shared layers where use_double_wide_mlp."""
        wide = config.use_double_wide_mlp and reads_shared_kv(config, layer_index)
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size * (2 if wide else 1),
            config.hidden_activation,
            tp=parallel.dense_tp,
            backend=backend,
        )

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        residual = hidden_states
        attended = self.self_attn(self.input_layernorm(hidden_states), rotary, forward_metadata, shared_kv)
        # pre_feedforward_layernorm(residual + post_attention_layernorm(attended)), and that sum
        hidden_states, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), residual)
        feed_forward = self.mlp(hidden_states)
        if self.enable_moe_block:
            tokens, own = self.experts.gather_tokens(residual)  # the router reads the residual stream
            routed = self.experts(self.pre_feedforward_layernorm_2(tokens), *self.router(tokens))[own]
            feed_forward = self.post_feedforward_layernorm_1(feed_forward) + self.post_feedforward_layernorm_2(routed)
        hidden_states = residual + self.post_feedforward_layernorm(feed_forward)
        if self.has_per_layer_input:
            gated = F.gelu(self.per_layer_input_gate(hidden_states), approximate="tanh") * per_layer_input
            hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden_states * self.layer_scalar


class Gemma4Model(LlamaModel):
    """Llama's stack with the scaled embedding, a rope table per layer type, the per-layer inputs
    (PLE) and the K/V that KV-shared layers read passed from layer to layer within a step."""

    def __init__(
        self,
        config: Gemma4TextConfig,
        parallel: ModelParallel,
        decoder_layer_cls: type[LlamaDecoderLayer],
        backend: Backend,
    ) -> None:
        super().__init__(config, parallel, decoder_layer_cls, backend)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        link_shared_kv_layers(config, self.layers)
        self.num_layers = config.num_hidden_layers
        self.per_layer_size = config.hidden_size_per_layer_input
        if self.per_layer_size:
            width = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                config.vocab_size_per_layer_input, width, parallel.embed_tp
            )
            self.register_buffer("per_layer_embed_scale", torch.tensor(self.per_layer_size**0.5), persistent=False)
            self.per_layer_model_projection = ColumnParallelLinear(
                config.hidden_size, width, linear_method=backend.linear_method()
            )
            self.per_layer_model_projection_scale = config.hidden_size**-0.5
            self.per_layer_projection_norm = RMSNorm(self.per_layer_size, config.rms_norm_eps, backend=backend)

    def build_rotary(self, config: Gemma4TextConfig) -> nn.Module:
        """One cos/sin table per layer type, over that type's head_dim and rope_parameters."""
        return nn.ModuleDict(
            {
                layer_type: RotaryEmbedding(config.per_layer_config[layer_type], head_dim, layer_type=layer_type)
                for layer_type in sorted(set(config.layer_types))
                for head_dim in [config.per_layer_config[layer_type].head_dim]
            }
        )

    def per_layer_inputs(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, per_layer_size]: each token's row of the per-layer table (scaled), averaged
        with the normed projection of its embedding, as transformers' get/project_per_layer_inputs."""
        shape = (-1, self.num_layers, self.per_layer_size)
        token_part = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).view(shape)
        projected = self.per_layer_model_projection(inputs_embeds) * self.per_layer_model_projection_scale
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + token_part) * 2.0**-0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        per_layer_inputs = self.per_layer_inputs(input_ids, hidden_states) if self.per_layer_size else None
        rotary = {layer_type: table(positions, hidden_states.dtype) for layer_type, table in self.rotary_emb.items()}
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, layer in enumerate(self.layers):
            per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, index]
            rope = rotary[layer.self_attn.layer_type]
            hidden_states = layer(hidden_states, per_layer_input, rope, shared_kv, forward_metadata)
        return self.norm(hidden_states)


def link_shared_kv_layers(config: Gemma4TextConfig, layers: nn.ModuleList) -> None:
    """Point each KV-shared layer's attention at the cache of the layer that stores K/V for its
    type (kv_sharing_modes "store": the last earlier layer of that type), as transformers pairs them."""
    sources = {
        config.layer_types[i]: layers[i].self_attn.attn
        for i, mode in enumerate(config.kv_sharing_modes)
        if mode == "store"
    }
    for i, layer in enumerate(layers):
        if layer.self_attn.reads_shared_kv:
            layer.self_attn.attn.read_kv_of(sources[config.layer_types[i]])


def check_config(config: Gemma4TextConfig) -> None:
    """What this build follows transformers in: layer types, activation, causal attention, no MTP."""
    layer_types = list(config.layer_types)
    if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ValueError(
            f"config layer_types must name one of {list(LAYER_TYPES)} for each of the {config.num_hidden_layers} "
            f"layers, got {layer_types}"
        )
    if config.hidden_activation != HIDDEN_ACTIVATION:
        raise ValueError(f"config hidden_activation must be {HIDDEN_ACTIVATION!r}, got {config.hidden_activation!r}")
    if config.use_bidirectional_attention == "all":
        raise ValueError("config use_bidirectional_attention 'all': only causal attention is built")
    if num_mtp_layers_of(config):
        raise ValueError("config num_nextn_predict_layers: Gemma 4 has no MTP modules; remove the key")


class Gemma4ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma4DecoderLayer
    base_model_cls = Gemma4Model

    def __init__(self, hf_config: Gemma4TextConfig, *, parallel: ModelParallel = ONE_PROCESS, backend: Backend) -> None:
        check_config(hf_config)
        needed = ("gelu_tanh_and_mul",) + (Gemma4Experts.NEEDED_OPS if hf_config.enable_moe_block else ())
        backend.require(needed, "Gemma 4")
        super().__init__(hf_config, parallel=parallel, backend=backend)
        self.final_logit_softcapping = hf_config.final_logit_softcapping

    def compute_logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, soft-capped to (-cap, cap) where the config sets a cap."""
        logits = super().compute_logits(hidden_states, row_indices)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (a text checkpoint's, or a multimodal one's language model);
        returns the parameters that received every shard they need."""
        return super().load_weights(self._text_weights(weights))

    def _text_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The text model's tensors under Gemma4ForCausalLM's names: a multimodal checkpoint's
        model.language_model.* renamed, its towers and projectors dropped, and the k/v tensors a
        KV-shared layer has no use for (as transformers ignores them) dropped."""
        for name, tensor in weights:
            if name.startswith(MULTIMODAL_PREFIXES):
                continue
            if name.startswith(LANGUAGE_MODEL_PREFIX):
                name = "model." + name.removeprefix(LANGUAGE_MODEL_PREFIX)
            if self._unused_by_shared_layer(name):
                continue
            yield name, tensor

    def _unused_by_shared_layer(self, name: str) -> bool:
        parts = name.split(".")  # model.layers.<i>.self_attn.<module>.weight
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn" or not parts[2].isdigit():
            return False
        index = int(parts[2])
        shared = index < self.config.num_hidden_layers and reads_shared_kv(self.config, index)
        return shared and parts[4] in SHARED_LAYER_UNUSED

    def _shards_needed(self, name: str) -> int:
        """A layer's fused q/k/v takes one tensor per part it holds ("qk" without v, "q" when KV-shared)."""
        if name.endswith(".self_attn.qkv_proj.weight") or name.endswith(".self_attn.qkv_proj.bias"):
            return len(self.get_submodule(name.rsplit(".", 1)[0]).parts)
        return super()._shards_needed(name)
