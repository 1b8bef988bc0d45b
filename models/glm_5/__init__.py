"""GLM-5: the model and HF config classes the engine builds, and the cann-recipes names it answers to."""

from transformers import GlmMoeDsaConfig

from models.glm_5.model import GlmMoeDsaForCausalLM

model_cls = GlmMoeDsaForCausalLM
config_cls = GlmMoeDsaConfig
# cann-recipes model names of GLM-5's architecture (DeepSeek-V3.2's, interleaved indexer rope, IndexShare):
# its glm_5 folder, and its glm_5_2 folder, whose files name the model "GLM-5.2".
model_names: tuple[str, ...] = ("glm_5", "glm_5_2", "GLM-5.2")

__all__ = ["GlmMoeDsaForCausalLM", "config_cls", "model_cls", "model_names"]
