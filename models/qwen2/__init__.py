"""Qwen2 / Qwen2.5: the model class, the HF config class the engine builds it from, and the
cann-recipes model_config.model_name values that mean this family."""

from transformers import Qwen2Config

from models.qwen2.model import Qwen2ForCausalLM

model_cls = Qwen2ForCausalLM
config_cls = Qwen2Config
model_names: tuple[str, ...] = ("qwen25_7b_instruct",)

__all__ = ["Qwen2ForCausalLM", "config_cls", "model_cls", "model_names"]
