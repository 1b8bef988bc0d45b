"""Hunyuan 3: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import HYV3Config

from models.hy3.model import Hy3ForCausalLM

model_cls = Hy3ForCausalLM
config_cls = HYV3Config
# cann-recipes model names of the Hy3 architecture (GQA with q/k norms, sigmoid-routed MoE with shared experts).
model_names: tuple[str, ...] = ("hy3",)

__all__ = ["Hy3ForCausalLM", "config_cls", "model_cls", "model_names"]
