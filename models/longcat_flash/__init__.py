"""LongCat-Flash: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import LongcatFlashConfig

from models.longcat_flash.model import LongcatFlashForCausalLM

model_cls = LongcatFlashForCausalLM
config_cls = LongcatFlashConfig
# cann-recipes model names of the LongCat-Flash architecture (two MLA blocks per layer, shortcut MoE
# with zero-computation experts).
model_names: tuple[str, ...] = ("longcat_flash",)

__all__ = ["LongcatFlashForCausalLM", "config_cls", "model_cls", "model_names"]
