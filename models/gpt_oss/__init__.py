"""gpt-oss: the model class, the HF config class the engine builds it from, and the cann-recipes
model_config.model_name values it serves."""

from transformers import GptOssConfig

from models.gpt_oss.model import GptOssForCausalLM

model_cls = GptOssForCausalLM
config_cls = GptOssConfig
model_names = ("gpt_oss",)

__all__ = ["GptOssForCausalLM", "config_cls", "model_cls", "model_names"]
