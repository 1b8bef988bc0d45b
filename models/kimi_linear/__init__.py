"""Kimi-Linear: the model and HF config classes the engine builds, and the names it answers to."""

from transformers import KimiLinearConfig

from models.kimi_linear.model import KimiLinearForCausalLM

model_cls = KimiLinearForCausalLM
config_cls = KimiLinearConfig
# No cann-recipes recipe runs Kimi-Linear (its kimi_k3 is another architecture: models/__init__.py's
# NOT_BUILT says why); the folder's own name finds it.
model_names: tuple[str, ...] = ()

__all__ = ["KimiLinearForCausalLM", "config_cls", "model_cls", "model_names"]
