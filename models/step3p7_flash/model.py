"""Step-3.7-Flash's text model (every checkpoint whose text config loads as transformers'
Step3p7TextConfig; transformers runs it inside Step3p7ForConditionalGeneration) on Llama's skeleton:
the same embedding, pre-norm blocks and GQA projections, with

- Gemma-style RMSNorms (x̂ * (1 + w)): the checkpoint's w is stored as 1 + w at load, so the
  backend's plain RMSNorm computes them, norms of q and k per head included (before rope);
- per-layer-type attention (config.layer_types): sliding layers attend over config.sliding_window
  tokens with their own head count (config.per_layer_config, from num_sliding_attention_heads) and
  their own rope; each type's rope table has the frequencies transformers' Step3p7RotaryEmbedding
  computes (theta, partial rotary factor, llama3 scaling on full layers), and only the first
  partial_rotary_factor of each head's dims rotate;
- a sigmoid gate per head on the attention's output, from its own projection g_proj;
- MoE on the layers config.mlp_layer_types marks sparse (dense SwiGLU elsewhere): sigmoid scores
  with a per-expert bias that steers the choice but not the weights, top-k over all experts,
  renormalised, times moe_router_scaling_factor (module.moe.TopkRouter with one group, op for op
  as transformers' Step3p7TopKRouter, so that ties break the same way), plus one shared expert;
- a clamped SwiGLU (silu(gate) <= limit, |up| <= limit) where config.swiglu_limits (routed
  experts) and swiglu_limits_shared (shared expert, and the dense MLP of that layer, as
  transformers builds it) give a layer a nonzero limit.

Checkpoints store each layer's routed experts stacked (moe.{gate,up,down}_proj.weight [E, ...]),
the router as moe.gate / moe.router_bias and the shared expert as share_expert. The vision tower,
its projector and the MTP layers (model.layers.{N+i}) are not built: transformers 5.24 defines no
MTP module for Step-3.7 (Step3p7TextModel drops those tensors at load) and cann-recipes runs the
text backbone without them. Parity with transformers: tests/test_step3p7_flash_parity.py.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Iterator

import torch
from torch import nn
from transformers import Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import Step3p7RotaryEmbedding as HFRotaryEmbedding

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError
from models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from module.linear import ColumnParallelLinear
from module.mlp import GatedMLP
from module.moe import FusedExperts, SparseMoeBlock, TopkRouter
from module.norm import RMSNorm
from module.parallel_group import ONE_PROCESS, ModelParallel, ParallelGroup
from module.rotary import RotaryEmbedding
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend

LAYER_TYPES = ("full_attention", "sliding_attention")
# Rope tables here are precomputed per position: types that change with the sequence length cannot be.
UNTABULATED_ROPE_TYPES = ("dynamic", "longrope")
# A layer's stacked routed experts in a checkpoint, after the renaming of _renamed.
STACKED_EXPERTS = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<projection>gate_proj|up_proj|down_proj)$")
# The checkpoint's names -> ours (the MoE block is our layer's `mlp`).
RENAMES = (
    (".moe.gate.weight", ".mlp.gate.weight"),
    (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
    (".share_expert.", ".mlp.shared_experts."),
)
MOE_PROJECTION = re.compile(r"\.moe\.(gate_proj|up_proj|down_proj)\.weight$")
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
NOT_BUILT = ("vision_model.", "model.vision_model.", "vit_large_projector.")


def layer_limit(limits: list[float | None] | None, layer_index: int) -> float | None:
    """A layer's SwiGLU clamp; a 0 or null entry, or no list, means none (as transformers reads them)."""
    return (limits[layer_index] or None) if limits else None


class ClampedGatedMLP(GatedMLP):
    """GatedMLP with silu(gate) clamped from above and up to [-limit, limit]."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, limit: float, tp: ParallelGroup, *, backend: Backend
    ) -> None:
        backend.require(("clamped_silu_and_mul",), "Step-3.7-Flash's clamped SwiGLU")
        super().__init__(hidden_size, intermediate_size, tp=tp, backend=backend)
        self.limit = limit

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.clamped_silu_and_mul(gate_up, self.limit)


def swiglu_mlp(
    hidden_size: int, intermediate_size: int, limit: float | None, tp: ParallelGroup, backend: Backend
) -> GatedMLP:
    if limit is None:
        return GatedMLP(hidden_size, intermediate_size, tp=tp, backend=backend)
    return ClampedGatedMLP(hidden_size, intermediate_size, limit, tp, backend=backend)


class Step3p7Attention(LlamaAttention):
    """Llama's attention over the layer's own config (its head count), with Gemma-style q/k norms per
    head, partial rope by the layer type's table, and a sigmoid gate per head on the output."""

    def __init__(self, config: Step3p7TextConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        layer_config = config.per_layer_config[layer_index]
        super().__init__(layer_config, layer_index, parallel, backend)
        self.layer_type = config.layer_types[layer_index]
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend=backend)
        self.g_proj = ColumnParallelLinear(
            config.hidden_size,
            layer_config.num_attention_heads,
            tp=parallel.attn_tp,
            linear_method=backend.linear_method(),
        )

    def attention_scale(self, config: Step3p7TextConfig) -> float:
        return config.query_pre_attn_scalar**-0.5

    @staticmethod
    def layer_sliding_window(config: Step3p7TextConfig, layer_index: int) -> int | None:
        return config.sliding_window if config.layer_types[layer_index] == "sliding_attention" else None

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = super().project_qkv(hidden_states)
        return self.q_norm(query), self.k_norm(key), value

    def rotate(
        self, query: torch.Tensor, key: torch.Tensor, rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary` holds the step's (cos, sin) [T, rotated dims] per layer type; the dims past them pass."""
        cos, sin = rotary[self.layer_type]
        rotated = cos.shape[-1]
        if rotated == self.head_dim:
            return self.ops.apply_rotary(query, key, cos, sin)
        query_rot, key_rot = self.ops.apply_rotary(
            query[..., :rotated].contiguous(), key[..., :rotated].contiguous(), cos, sin
        )
        return torch.cat([query_rot, query[..., rotated:]], dim=-1), torch.cat([key_rot, key[..., rotated:]], dim=-1)

    def attend(
        self,
        hidden_states: torch.Tensor,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        output = super().attend(hidden_states, rotary, forward_metadata)
        return output * self.g_proj(hidden_states).sigmoid().unsqueeze(-1)


class Step3p7Experts(FusedExperts):
    """FusedExperts loaded from stacked checkpoint tensors ([E, I, H] gate and up, [E, H, I] down),
    run with the clamped SwiGLU where the layer has a limit."""

    def __init__(
        self,
        config: Step3p7TextConfig,
        limit: float | None,
        tp: ParallelGroup,
        ep: ParallelGroup,
        backend: Backend,
    ) -> None:
        if limit is not None:
            backend.require(("moe_experts_clamped_silu",), "Step-3.7-Flash's clamped experts")
        super().__init__(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, tp, ep, backend=backend
        )
        self.limit = limit

    def load_stacked(self, loaded_weight: LoadedWeight, projection: str) -> None:
        """One projection of every expert; only this EP rank's experts are read."""
        if loaded_weight.ndim != 3 or loaded_weight.shape[0] != self.num_experts:
            raise WeightLoadError(
                f"expected {self.num_experts} stacked experts (3 dims), got shape {tuple(loaded_weight.shape)}"
            )
        for expert in range(self.first_expert, self.first_expert + self.num_local_experts):
            self.load_expert_weight(materialize(loaded_weight.narrow(0, expert, 1))[0], expert, projection)

    def run_dense_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.limit is None:
            return super().run_dense_experts(hidden_states, topk_weights, topk_ids)
        return self.ops.moe_experts_clamped_silu(
            hidden_states, topk_weights, topk_ids, self.gate_up_proj, self.down_proj, self.limit
        )


class Step3p7MoE(SparseMoeBlock):
    def __init__(self, config: Step3p7TextConfig, layer_index: int, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(
            # One group of all experts: grouped_topk's group limit keeps every expert.
            TopkRouter(
                config.hidden_size,
                config.n_routed_experts,
                config.num_experts_per_tok,
                1,
                1,
                True,
                config.moe_router_scaling_factor,
            ),
            Step3p7Experts(
                config, layer_limit(config.swiglu_limits, layer_index), parallel.moe_tp, parallel.moe_ep, backend
            ),
            swiglu_mlp(
                config.hidden_size,
                config.share_expert_dim,
                layer_limit(config.swiglu_limits_shared, layer_index),
                parallel.dense_tp,
                backend,
            ),
        )


class Step3p7DecoderLayer(LlamaDecoderLayer):
    attention_cls = Step3p7Attention

    def build_mlp(
        self, config: Step3p7TextConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        if config.mlp_layer_types[layer_index] == "sparse":
            return Step3p7MoE(config, layer_index, parallel, backend)
        limit = layer_limit(config.swiglu_limits_shared, layer_index)  # transformers' dense MLP reads this list too
        return swiglu_mlp(config.hidden_size, config.intermediate_size, limit, parallel.dense_tp, backend)


class Step3p7Rotary(nn.Module):
    """One cos/sin table per layer type, of the frequencies transformers' Step3p7RotaryEmbedding
    computes; (positions, dtype) -> {layer type: (cos, sin) [T, rotated dims]}."""

    def __init__(self, config: Step3p7TextConfig) -> None:
        super().__init__()
        reference = HFRotaryEmbedding(config)
        tables = {}
        for layer_type in reference.layer_types:
            inv_freq = getattr(reference, f"{layer_type}_inv_freq")
            scaling = getattr(reference, f"{layer_type}_attention_scaling")
            tables[layer_type] = RotaryEmbedding(config, 2 * inv_freq.numel(), frequencies=(inv_freq, scaling))
        self.tables = nn.ModuleDict(tables)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {layer_type: table(positions, dtype) for layer_type, table in self.tables.items()}


class Step3p7Model(LlamaModel):
    @staticmethod
    def build_rotary(config: Step3p7TextConfig) -> nn.Module:
        return Step3p7Rotary(config)


def check_config(config: Step3p7TextConfig) -> None:
    """Refuse, before anything is built, what transformers would run otherwise than built here."""
    layer_types = list(config.layer_types)
    if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ValueError(
            f"config layer_types must name one of {list(LAYER_TYPES)} for each of the "
            f"{config.num_hidden_layers} layers, got {layer_types}"
        )
    if "sliding_attention" in layer_types and not config.sliding_window:
        raise ValueError(f"config has sliding_attention layers but sliding_window {config.sliding_window!r}")
    if config.use_bidirectional_attention:
        raise ValueError("config use_bidirectional_attention: only causal attention is built")
    if not (config.gating is True or config.gating == "per-head"):  # transformers' forward cannot run the others
        raise ValueError(f"config gating {config.gating!r}: only the per-head output gate is built")
    for layer_type, parameters in config.rope_parameters.items():
        if parameters["rope_type"] in UNTABULATED_ROPE_TYPES:
            raise ValueError(
                f"config rope_parameters[{layer_type!r}] rope_type {parameters['rope_type']!r} changes its "
                "frequencies with the sequence length, which a precomputed cos/sin table cannot follow"
            )


class Step3p7ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Step3p7DecoderLayer
    base_model_cls = Step3p7Model
    mtp_absent_reason = "Step-3.7's MTP layers are not built: transformers defines no Step-3.7 MTP module"

    def __init__(
        self, hf_config: Step3p7TextConfig, *, parallel: ModelParallel = ONE_PROCESS, backend: Backend
    ) -> None:
        check_config(hf_config)
        super().__init__(hf_config, parallel=parallel, backend=backend)

    @staticmethod
    def mtp_layers_to_build(config: Step3p7TextConfig) -> int:
        """None: transformers defines no Step-3.7 MTP module to check them against."""
        return 0

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Load Step-3.7's checkpoint names (the text model's; the vision tower's and the MTP
        layers' are passed over); returns the parameters that received every shard they need."""
        return super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, tensor in weights:
            layer = LAYER_INDEX.match(name)
            if name.startswith(NOT_BUILT) or (layer and int(layer[1]) >= self.config.num_hidden_layers):
                continue
            for old, new in RENAMES:
                name = name.replace(old, new)
            name = MOE_PROJECTION.sub(r".mlp.experts.\1", name)
            if name.endswith("norm.weight"):  # Gemma-style: the checkpoint stores w of (1 + w)
                tensor = materialize(tensor).float() + 1
            yield name, tensor

    def _load_tensor(
        self, checkpoint_name: str, tensor: LoadedWeight, params: dict[str, nn.Parameter]
    ) -> tuple[str, Hashable]:
        match = STACKED_EXPERTS.match(checkpoint_name)
        if match is None:
            return super()._load_tensor(checkpoint_name, tensor, params)
        experts = self.get_submodule(match["module"])
        projection = match["projection"]
        experts.load_stacked(tensor, projection)
        stacked = "down_proj" if projection == "down_proj" else "gate_up_proj"
        return f"{match['module']}.{stacked}", projection

    def _shards_needed(self, name: str) -> int:
        """A stacked gate_up_proj takes the gate and the up tensor; other parameters as Llama's."""
        module_name, _, param_name = name.rpartition(".")
        if isinstance(self.get_submodule(module_name), FusedExperts):
            return 2 if param_name == "gate_up_proj" else 1
        return super()._shards_needed(name)
