"""DeepSeek-V3: the model class and the HF config class the engine builds it from."""

from transformers import DeepseekV3Config

from models.deepseek_v3.model import DeepseekV3ForCausalLM

model_cls = DeepseekV3ForCausalLM
config_cls = DeepseekV3Config

__all__ = ["DeepseekV3ForCausalLM", "config_cls", "model_cls"]
