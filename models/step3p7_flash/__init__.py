"""Step-3.7-Flash's text model: the model class, the HF config class the engine builds it from (the
text config, which transformers reads out of the multimodal config.json's text_config), and the
cann-recipes model_config.model_name values it serves."""

from transformers import Step3p7TextConfig

from models.step3p7_flash.model import Step3p7ForCausalLM

model_cls = Step3p7ForCausalLM
config_cls = Step3p7TextConfig
model_names = ("step3p7_flash",)

__all__ = ["Step3p7ForCausalLM", "config_cls", "model_cls", "model_names"]
