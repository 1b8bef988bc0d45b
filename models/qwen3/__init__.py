"""Qwen3: the model class, the HF config class the engine builds it from, and the cann-recipes
model_config.model_name values that mean this family."""

from transformers import Qwen3Config

from models.qwen3.model import Qwen3ForCausalLM

model_cls = Qwen3ForCausalLM
config_cls = Qwen3Config
model_names: tuple[str, ...] = ("qwen3_8b",)

__all__ = ["Qwen3ForCausalLM", "config_cls", "model_cls", "model_names"]
