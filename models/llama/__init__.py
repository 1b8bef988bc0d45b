"""Llama: the model class and the HF config class the engine builds it from."""

from transformers import LlamaConfig

from models.llama.model import LlamaForCausalLM

model_cls = LlamaForCausalLM
config_cls = LlamaConfig

__all__ = ["LlamaForCausalLM", "config_cls", "model_cls"]
