"""Qwen3-Next: the model class, the HF config class the engine builds it from, and the cann-recipes
model_config.model_name values that mean this family: none (cann-recipes has no Qwen3-Next folder);
`model_name: qwen3_next` names this folder."""

from transformers import Qwen3NextConfig

from models.qwen3_next.model import Qwen3NextForCausalLM

model_cls = Qwen3NextForCausalLM
config_cls = Qwen3NextConfig
model_names: tuple[str, ...] = ()

__all__ = ["Qwen3NextForCausalLM", "config_cls", "model_cls", "model_names"]
