"""Hunyuan 3 (Hy3; every checkpoint that loads as transformers' HYV3ForCausalLM, model_type hy_v3):
Qwen3's attention (an RMSNorm over each head of q and k before rope, Llama's attention_bias), a
dense MLP or a sparse MoE block per layer as config.mlp_layer_types says (the first layer dense in
the released models, as DeepSeek-V3's first_k_dense_replace), and MTP modules as DeepSeek's.

The MoE block is module/moe.py's: SigmoidTopkRouter (transformers' HYV3TopKRouter op for op),
stacked FusedExperts and the shared experts as one wide MLP. Its enable_moe_fp32_combine needs no
code: torch adds two bf16 tensors in fp32 and rounds the sum once, which is what the option asks.
Checkpoints name the router, its bias and the shared experts otherwise than these modules
(CHECKPOINT_RENAMES). Parity with transformers: tests/test_hy3_parity.py.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable

import torch
from torch import nn
from transformers import HYV3Config, PretrainedConfig

from models.llama.model import LlamaAttention, LlamaDecoderLayer
from models.qwen3.model import Qwen3Attention, Qwen3DecoderLayer
from models.qwen3_moe.model import Qwen3MoeForCausalLM
from module.mlp import GatedMLP
from module.moe import FusedExperts, SigmoidTopkRouter, SparseMoeBlock
from module.parallel_group import ONE_PROCESS, ModelParallel
from ops.backend import Backend

# (checkpoint name pattern, our name): Hy3's checkpoints (transformers' conversion mapping renames
# the same), and the MTP module's closing norm, which DeepSeek's checkpoints call shared_head.norm.
CHECKPOINT_RENAMES = (
    (re.compile(r"\.mlp\.router\.gate\.weight$"), ".mlp.gate.weight"),
    (re.compile(r"\.mlp\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.mlp\.shared_mlp\."), ".mlp.shared_experts."),
    (re.compile(r"^(mtp_layers\.\d+)\.final_layernorm\."), r"\1.shared_head.norm."),
)
MLP_LAYER_TYPES = ("dense", "sparse")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class Hy3Attention(Qwen3Attention):
    layer_sliding_window = staticmethod(LlamaAttention.layer_sliding_window)  # no window, no layer_types


class Hy3MoE(SparseMoeBlock):
    """Routed experts chosen by SigmoidTopkRouter, plus num_shared_experts as one wide MLP (with
    mlp_bias, as transformers builds it)."""

    def __init__(self, config: HYV3Config, parallel: ModelParallel, backend: Backend) -> None:
        super().__init__(
            SigmoidTopkRouter(
                config.hidden_size, config.num_experts, config.num_experts_per_tok, config.router_scaling_factor
            ),
            FusedExperts(
                config.num_experts,
                config.hidden_size,
                config.moe_intermediate_size,
                parallel.moe_tp,
                parallel.moe_ep,
                backend=backend,
            ),
            GatedMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.num_shared_experts,
                config.hidden_act,
                bias=config.mlp_bias,
                tp=parallel.moe_tp,
                backend=backend,
            ),
        )


class Hy3DecoderLayer(Qwen3DecoderLayer):
    attention_cls = Hy3Attention

    def build_mlp(
        self, config: PretrainedConfig, layer_index: int, parallel: ModelParallel, backend: Backend
    ) -> nn.Module:
        """Hy3's MoE where mlp_layer_types says sparse, else Llama's MLP (with mlp_bias, as transformers')."""
        if config.mlp_layer_types[layer_index] == "sparse":
            return Hy3MoE(config, parallel, backend)
        return LlamaDecoderLayer.build_mlp(self, config, layer_index, parallel, backend)


class Hy3ForCausalLM(Qwen3MoeForCausalLM):
    """Loads Hy3's checkpoint names (CHECKPOINT_RENAMES); MTP layers are built as the last decoder layer."""

    decoder_layer_cls = Hy3DecoderLayer

    def __init__(self, hf_config: HYV3Config, *, parallel: ModelParallel = ONE_PROCESS, backend: Backend) -> None:
        self.check_config(hf_config)
        super().__init__(hf_config, parallel=parallel, backend=backend)

    @staticmethod
    def check_config(config: HYV3Config) -> None:
        """Refuse, before anything is built, what transformers would not build either: a layer without
        a known MLP type, shared experts of no width (transformers builds an MLP of 0 units), or MTP
        layers that would not be sparse as the checkpoints' are."""
        types = list(config.mlp_layer_types)
        if len(types) < config.num_hidden_layers or not set(types) <= set(MLP_LAYER_TYPES):
            raise ValueError(
                f"config mlp_layer_types {types}: need one of {MLP_LAYER_TYPES} per layer "
                f"({config.num_hidden_layers} layers)"
            )
        if not config.num_shared_experts:
            raise ValueError(f"config num_shared_experts {config.num_shared_experts}: Hy3 has shared experts")
        if getattr(config, "num_nextn_predict_layers", None) and types[config.num_hidden_layers - 1] != "sparse":
            raise ValueError("config num_nextn_predict_layers: Hy3's MTP layer is sparse, built as the last layer is")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Without MTP layers (num_nextn_predict_layers 0 or absent), the checkpoint's MTP tensors
        (model.layers.N.*) are skipped, as transformers skips them."""
        if self.num_mtp_layers == 0:
            weights = ((name, tensor) for name, tensor in weights if not self._is_mtp_tensor(name))
        return super().load_weights(weights)

    def _is_mtp_tensor(self, checkpoint_name: str) -> bool:
        match = _LAYER_INDEX.match(checkpoint_name)
        return match is not None and int(match[1]) >= self.config.num_hidden_layers

    def _load_tensor(
        self, checkpoint_name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, Hashable]:
        for pattern, name in CHECKPOINT_RENAMES:
            checkpoint_name = pattern.sub(name, checkpoint_name)
        return super()._load_tensor(checkpoint_name, tensor, params)
