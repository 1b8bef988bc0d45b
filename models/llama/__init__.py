"""Llama: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import LlamaConfig

from models.llama.model import LlamaForCausalLM

model_cls = LlamaForCausalLM
config_cls = LlamaConfig
# cann-recipes has no Llama model; the folder name is the only one.
model_names: tuple[str, ...] = ()

__all__ = ["LlamaForCausalLM", "config_cls", "model_cls", "model_names"]
