"""Gemma 4 (its text model): the model class, the HF config class the engine builds it from (a
multimodal checkpoint's config.json gives its text_config), and the cann-recipes
model_config.model_name values it serves."""

from transformers import Gemma4TextConfig

from models.gemma_4.model import Gemma4ForCausalLM

model_cls = Gemma4ForCausalLM
config_cls = Gemma4TextConfig
model_names = ("gemma_4",)

__all__ = ["Gemma4ForCausalLM", "config_cls", "model_cls", "model_names"]
