"""DeepSeek-V3 (every checkpoint that loads as transformers' DeepseekV3ForCausalLM) on the packed TND
path, with its multi-token-prediction (MTP) modules.

MLA attention over a paged cache of latents (module/mla.py); a dense MLP in the first
first_k_dense_replace layers and MoE after them (shared experts plus routed experts with V3's
grouped routing, module/moe.py); num_nextn_predict_layers MTP modules, which the main forward never
runs and the speculative-decoding worker drives through mtp_forward / mtp_compute_logits. Parity
with transformers: tests/test_deepseek_v3_parity.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import DeepseekV3Config

from executor.types_.errors import WeightLoadError
from module.causal_lm import CausalLM, PreNormDecoderLayer
from module.embedding import ParallelLMHead, VocabParallelEmbedding
from module.mla import MLAAttention
from module.mlp import GatedMLP
from module.moe import FusedExperts, Router, SparseMoeBlock, TopkRouter, load_expert_tensor
from module.mtp import SHARED_MTP_TENSOR, MTPLayerMixin, num_mtp_layers_of
from module.norm import RMSNorm
from module.parallel_group import ONE_PROCESS, ModelParallel
from module.rotary import RotaryEmbedding
from module.weights import ShardId, fused_shards_needed, load_fused_tensor
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend

# Which part of a parameter a checkpoint tensor filled: a merged layer's shard, or (expert, projection).
ShardKey = ShardId | tuple[int, str]


class DeepseekV3MoE(SparseMoeBlock):
    """V3's grouped sigmoid router over the routed experts, plus n_shared_experts as one wide MLP."""

    def __init__(self, config: DeepseekV3Config, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(
            self.build_router(config),
            FusedExperts(
                self.num_routed_experts(config),
                config.hidden_size,
                config.moe_intermediate_size,
                parallel.moe_tp,
                parallel.moe_ep,
                backend=backend,
            ),
            GatedMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.hidden_act,
                tp=parallel.moe_tp,
                backend=backend,
            )
            if config.n_shared_experts
            else None,
        )

    @staticmethod
    def num_routed_experts(config: DeepseekV3Config) -> int:
        return config.n_routed_experts

    @classmethod
    def build_router(cls, config: DeepseekV3Config) -> Router:
        return TopkRouter(
            config.hidden_size,
            cls.num_routed_experts(config),
            config.num_experts_per_tok,
            config.n_group or 1,
            config.topk_group or 1,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    attention_cls: type[MLAAttention] = MLAAttention
    moe_cls: type[DeepseekV3MoE] = DeepseekV3MoE

    def __init__(self, config: DeepseekV3Config, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.self_attn = self.build_attention(config, layer_index, parallel, backend)
        if self.is_moe_layer(config, layer_index):
            self.mlp = self.moe_cls(config, parallel, backend)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, tp=parallel.dense_tp, backend=backend
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)

    def build_attention(
        self, config: DeepseekV3Config, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """Layer `layer_index`'s attention (hidden, rotary, metadata -> hidden): MLA in every layer here."""
        return self.attention_cls(config, parallel.attn_tp, backend=backend)

    @staticmethod
    def is_moe_layer(config: DeepseekV3Config, layer_index: int) -> bool:
        """MoE after the first first_k_dense_replace layers (the MTP layers' indices included)."""
        return layer_index >= config.first_k_dense_replace


class DeepseekV3MTPLayer(MTPLayerMixin, DeepseekV3DecoderLayer):
    """One MTP module (DeepSeek-V3 report, section 2.2; module/mtp.py) on one more decoder layer, built
    as layer index N + i would be, so that checkpoint names model.layers.{N+i}.* map onto it unchanged."""


class DeepseekV3Model(nn.Module):
    decoder_layer_cls: type[DeepseekV3DecoderLayer] = DeepseekV3DecoderLayer
    mtp_layer_cls: type[DeepseekV3DecoderLayer] = DeepseekV3MTPLayer

    def __init__(self, config: DeepseekV3Config, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__()
        self.num_hidden_layers = self.num_decoder_layers(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.embed_tp)
        # The MTP modules follow the decoder layers in one list, indexed as in the checkpoints.
        self.layers = nn.ModuleList(
            [self.decoder_layer_cls(config, index, parallel, backend) for index in range(self.num_hidden_layers)]
            + [
                self.mtp_layer_cls(config, self.num_hidden_layers + index, parallel, backend)
                for index in range(self.num_mtp_layers(config))
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=backend)
        self.rotary_emb = self.build_rotary(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(positions, hidden_states.dtype)
        hidden_states, residual = self.run_layers(hidden_states, rotary, forward_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def run_layers(
        self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], forward_metadata: ForwardMetaData
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers (not the MTP ones) in turn -> (output, residual) of the last."""
        residual = None
        for layer in self.layers[: self.num_hidden_layers]:
            hidden_states, residual = layer(hidden_states, residual, rotary, forward_metadata)
        return hidden_states, residual

    @staticmethod
    def num_decoder_layers(config: DeepseekV3Config) -> int:
        """How many decoder layers `layers` holds before the MTP ones (LongCat's hold two attention blocks each)."""
        return config.num_hidden_layers

    @staticmethod
    def build_rotary(config: DeepseekV3Config) -> nn.Module:
        """One cos/sin table of the rope dims for all layers, looked up once per step."""
        return RotaryEmbedding(config, config.qk_rope_head_dim)

    @staticmethod
    def num_mtp_layers(config: DeepseekV3Config) -> int:
        """How many MTP layers `layers` holds after the decoder ones."""
        return num_mtp_layers_of(config)


class DeepseekV3ForCausalLM(CausalLM):
    # checkpoint module name -> (our fused module, shard id passed to its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    base_model_cls: type[DeepseekV3Model] = DeepseekV3Model
    family = "DeepSeek-V3"  # names the model in a refusal
    NEEDED_OPS: tuple[str, ...] = (
        *MLAAttention.NEEDED_OPS,
        *FusedExperts.NEEDED_OPS,
    )  # refused on a backend without them

    def __init__(self, hf_config: DeepseekV3Config, *, parallel: ModelParallel = ONE_PROCESS, backend: Backend) -> None:
        super().__init__()
        backend.require(self.NEEDED_OPS, self.family)
        self.check_config(hf_config)
        self.config = hf_config
        self.model = self.base_model_cls(hf_config, parallel, backend)
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size, hf_config.hidden_size, parallel.lmhead_tp, backend.linear_method()
        )
        if self.ties_word_embeddings(hf_config):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_mtp_layers = self.mtp_layers_to_build(hf_config)

    @classmethod
    def mtp_layers_to_build(cls, config: DeepseekV3Config) -> int:
        """Those that base_model_cls's `layers` holds after the decoder layers."""
        return cls.base_model_cls.num_mtp_layers(config)

    @staticmethod
    def check_config(config: DeepseekV3Config) -> None:
        """Refuse, before anything is built, a config whose architecture this class does not build:
        V2-era routing (softmax scores, greedy top-k) is models/deepseek_v2's."""
        scoring_func = getattr(config, "scoring_func", "sigmoid")
        topk_method = getattr(config, "topk_method", "noaux_tc")
        if (scoring_func, topk_method) != ("sigmoid", "noaux_tc"):
            raise ValueError(
                f"config scoring_func {scoring_func!r} / topk_method {topk_method!r}: only DeepSeek-V3's "
                "'sigmoid' / 'noaux_tc' routing is built here (DeepSeek-V2's is models/deepseek_v2/)"
            )

    @staticmethod
    def ties_word_embeddings(config: DeepseekV3Config) -> bool:
        """Whether the LM head is the embedding matrix, as transformers' class decides it."""
        return config.tie_word_embeddings

    def mtp_layer(self, layer: int) -> DeepseekV3MTPLayer:
        if not 0 <= layer < self.num_mtp_layers:
            raise IndexError(f"MTP layer {layer} does not exist: the model has {self.num_mtp_layers}")
        return self.model.layers[self.model.num_hidden_layers + layer]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (one per routed expert and projection, as DeepSeek checkpoints store
        them); returns the parameters that received every shard they need."""
        params = dict(self.named_parameters())
        received: dict[str, set[ShardKey]] = {}
        for checkpoint_name, tensor in weights:
            checkpoint_name = self.checkpoint_name(checkpoint_name)
            if self._is_skipped(checkpoint_name):
                continue
            try:
                name, shard = self._load_tensor(checkpoint_name, tensor, params)
            except WeightLoadError as error:
                raise WeightLoadError(f"checkpoint tensor {checkpoint_name!r}: {error}") from None
            received.setdefault(name, set()).add(shard)
        return {name for name, shards in received.items() if len(shards) == self._shards_needed(name)}

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this model's modules spell it (a family whose checkpoints
        name modules otherwise renames them here)."""
        return name

    def _is_skipped(self, checkpoint_name: str) -> bool:
        return (
            "rotary_emb.inv_freq" in checkpoint_name
            or (checkpoint_name == "lm_head.weight" and self.ties_word_embeddings(self.config))
            or SHARED_MTP_TENSOR.match(checkpoint_name) is not None
        )

    def _load_tensor(
        self,
        checkpoint_name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
    ) -> tuple[str, ShardKey]:
        """Copy one checkpoint tensor into its parameter; -> (parameter name, which shard it was)."""
        if checkpoint_name.endswith("_scale_inv"):
            raise WeightLoadError(
                "an FP8 block scale: quantized DeepSeek checkpoints are not supported, use a bf16 one"
            )
        expert = load_expert_tensor(self, checkpoint_name, tensor)
        if expert is not None:
            return expert
        return load_fused_tensor(self, checkpoint_name, tensor, params, self.packed_modules_mapping)

    def _shards_needed(self, name: str) -> int:
        """Stacked experts need one tensor per expert and projection; merged layers one per part."""
        module_name, _, param_name = name.rpartition(".")
        experts = self.get_submodule(module_name)
        if isinstance(experts, FusedExperts):
            return experts.checkpoint_tensors_needed(param_name)
        return fused_shards_needed(name, self.packed_modules_mapping)
