"""DeepSeek-V4: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import DeepseekV4Config

from models.deepseek_v4.model import DeepseekV4ForCausalLM

model_cls = DeepseekV4ForCausalLM
config_cls = DeepseekV4Config
# cann-recipes model names of the DeepSeek-V4 architecture (compressed KV, hyper-connections, hash routing).
model_names: tuple[str, ...] = ("deepseek_v4",)

__all__ = ["DeepseekV4ForCausalLM", "config_cls", "model_cls", "model_names"]
