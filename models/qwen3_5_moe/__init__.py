"""Qwen3.5-MoE: the model class, the HF config class the engine builds it from (the text model's; a
multimodal checkpoint's config.json gives its text_config), and the cann-recipes model_config.model_name
values that mean this family (`qwen3.5`: cann-recipes' Qwen3.5 configs are the 35B-A3B, 122B-A10B and
397B-A17B MoE checkpoints)."""

from transformers import Qwen3_5MoeTextConfig

from models.qwen3_5_moe.model import Qwen3_5MoeForCausalLM

model_cls = Qwen3_5MoeForCausalLM
config_cls = Qwen3_5MoeTextConfig
model_names: tuple[str, ...] = ("qwen3.5",)

__all__ = ["Qwen3_5MoeForCausalLM", "config_cls", "model_cls", "model_names"]
