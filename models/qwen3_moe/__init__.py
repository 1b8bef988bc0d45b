"""Qwen3-MoE: the model class, the HF config class the engine builds it from, and the cann-recipes
model_config.model_name values that mean this family."""

from transformers import Qwen3MoeConfig

from models.qwen3_moe.model import Qwen3MoeForCausalLM

model_cls = Qwen3MoeForCausalLM
config_cls = Qwen3MoeConfig
model_names: tuple[str, ...] = ("qwen3_moe",)

__all__ = ["Qwen3MoeForCausalLM", "config_cls", "model_cls", "model_names"]
