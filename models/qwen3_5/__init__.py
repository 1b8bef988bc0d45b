"""Qwen3.5 (dense): the model class, the HF config class the engine builds it from (the text model's;
a multimodal checkpoint's config.json gives its text_config), and the cann-recipes model_config.model_name
values that mean this family: none (cann-recipes' `qwen3.5` runs the MoE checkpoints, models/qwen3_5_moe);
`model_name: qwen3_5` names this folder."""

from transformers import Qwen3_5TextConfig

from models.qwen3_5.model import Qwen3_5ForCausalLM

model_cls = Qwen3_5ForCausalLM
config_cls = Qwen3_5TextConfig
model_names: tuple[str, ...] = ()

__all__ = ["Qwen3_5ForCausalLM", "config_cls", "model_cls", "model_names"]
