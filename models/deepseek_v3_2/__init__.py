"""DeepSeek-V3.2: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import DeepseekV32Config

from models.deepseek_v3_2.model import DeepseekV32ForCausalLM

model_cls = DeepseekV32ForCausalLM
config_cls = DeepseekV32Config
# cann-recipes model names of the DeepSeek-V3.2 architecture (MLA with sparse attention, MoE, MTP).
model_names: tuple[str, ...] = ("deepseek_v3_2_exp",)

__all__ = ["DeepseekV32ForCausalLM", "config_cls", "model_cls", "model_names"]
