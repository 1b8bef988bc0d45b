"""Ling 3 (Bailing hybrid): the model and HF config classes the engine builds, and the names it answers to."""

from transformers import BailingHybridConfig

from models.bailing_hybrid.model import BailingHybridForCausalLM

model_cls = BailingHybridForCausalLM
config_cls = BailingHybridConfig
# No cann-recipes recipe runs Ling 3 (its bailing_2_5 is Ling 2.5, another architecture:
# models/__init__.py's NOT_BUILT says why); the folder's own name finds it.
model_names: tuple[str, ...] = ()

__all__ = ["BailingHybridForCausalLM", "config_cls", "model_cls", "model_names"]
