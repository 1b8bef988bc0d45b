"""DeepSeek-V2 (every checkpoint that loads as transformers' DeepseekV2ForCausalLM: DeepSeek-V2,
V2-Lite, V2.5, Coder-V2) as models/deepseek_v3/'s classes with the three things V2 does otherwise.

- Routing: softmax scores, top-k over all experts (topk_method greedy) or within the topk_group
  groups of the best single scores (group_limited_greedy), no score-correction bias, weights scaled
  by routed_scaling_factor and never renormalised (module/moe.py's SoftmaxGroupRouter).
- Rope: always on interleaved pairs (transformers rotates (x0, x1), (x2, x3), ... as complex
  numbers; V2 configs have no rope_interleave), which MLA's de-interleaving reproduces.
- No MTP modules.

MLA with q_lora_rank None (V2-Lite's plain q_proj), the dense first_k_dense_replace layers, shared
experts and the loading of DeepSeek's tensor names are V3's. Parity with transformers:
tests/test_deepseek_v2_parity.py.
"""

from __future__ import annotations

from transformers import DeepseekV2Config

from models.deepseek_v3.model import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model, DeepseekV3MoE
from module.mla import MLAAttention
from module.moe import Router, SoftmaxGroupRouter

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Attention(MLAAttention):
    @staticmethod
    def interleaved_rope(config: DeepseekV2Config) -> bool:
        return True


class DeepseekV2MoE(DeepseekV3MoE):
    @staticmethod
    def build_router(config: DeepseekV2Config) -> Router:
        """greedy is one group of all experts; transformers reads n_group / topk_group only when grouped."""
        grouped = config.topk_method == "group_limited_greedy"
        return SoftmaxGroupRouter(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.n_group if grouped else 1,
            config.topk_group if grouped else 1,
            config.routed_scaling_factor,
        )


class DeepseekV2DecoderLayer(DeepseekV3DecoderLayer):
    attention_cls = DeepseekV2Attention
    moe_cls = DeepseekV2MoE


class DeepseekV2Model(DeepseekV3Model):
    decoder_layer_cls = DeepseekV2DecoderLayer

    @staticmethod
    def num_mtp_layers(config: DeepseekV2Config) -> int:
        return 0


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    base_model_cls = DeepseekV2Model
    mtp_absent_reason = "DeepSeek-V2 has no MTP modules"
    family = "DeepSeek-V2"

    @staticmethod
    def check_config(config: DeepseekV2Config) -> None:
        """Refuse what transformers' DeepseekV2ForCausalLM would build otherwise than DeepSeek's own code
        (it ignores scoring_func, norm_topk_prob and moe_layer_freq; DeepSeek's has no mlp_bias), so
        that no checkpoint runs as a model it is not; released V2 configs pass."""
        settings = {
            "topk_method": (config.topk_method, TOPK_METHODS),
            "scoring_func": (getattr(config, "scoring_func", "softmax"), ("softmax",)),
            "norm_topk_prob": (bool(config.norm_topk_prob), (False,)),
            "moe_layer_freq": (getattr(config, "moe_layer_freq", 1), (1,)),
            "mlp_bias": (config.mlp_bias, (False,)),
        }
        for key, (value, built) in settings.items():
            if value not in built:
                raise ValueError(
                    f"config {key} {value!r}: DeepSeek-V2 is built with {' or '.join(map(repr, built))} only"
                )
