"""DeepSeek-V3: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import DeepseekV3Config

from models.deepseek_v3.model import DeepseekV3ForCausalLM

model_cls = DeepseekV3ForCausalLM
config_cls = DeepseekV3Config
# cann-recipes model names of the DeepSeek-V3 architecture (MLA, sigmoid-routed MoE, MTP).
model_names: tuple[str, ...] = ("deepseek_r1", "kimi_k2", "kimi_k2_thinking")

__all__ = ["DeepseekV3ForCausalLM", "config_cls", "model_cls", "model_names"]
