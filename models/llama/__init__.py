"""Llama: the model and HF config classes the engine builds, its EAGLE-3 drafter, and the cann-recipes
names it answers to."""

from transformers import LlamaConfig

from models.llama.eagle3 import Eagle3Drafter
from models.llama.model import LlamaForCausalLM

model_cls = LlamaForCausalLM
config_cls = LlamaConfig
eagle3_drafter_cls = Eagle3Drafter  # speculative_config.method eagle3 (executor/core/spec_decode/eagle3.py)
# cann-recipes has no Llama model; the folder name is the only one.
model_names: tuple[str, ...] = ()

__all__ = ["Eagle3Drafter", "LlamaForCausalLM", "config_cls", "eagle3_drafter_cls", "model_cls", "model_names"]
