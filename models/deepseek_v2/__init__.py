"""DeepSeek-V2: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import DeepseekV2Config

from models.deepseek_v2.model import DeepseekV2ForCausalLM

model_cls = DeepseekV2ForCausalLM
config_cls = DeepseekV2Config
# cann-recipes model names of the DeepSeek-V2 architecture (MLA, softmax-routed MoE, no MTP).
model_names: tuple[str, ...] = ("deepseek_v2_lite",)

__all__ = ["DeepseekV2ForCausalLM", "config_cls", "model_cls", "model_names"]
