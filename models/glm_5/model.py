"""GLM-5 and GLM-5.2 (checkpoints that load as transformers' GlmMoeDsaForCausalLM) as
models/deepseek_v3_2/'s classes with GLM's two differences:

- The indexer ropes its first qk_rope_head_dim dims as interleaved pairs (the config's
  indexer_rope_interleave, true unless a config says otherwise).
- IndexShare (GLM-5.2): indexer_types marks each layer "full" (its own indexer and indexer key
  cache) or "shared" (no indexer, no indexer key: the previous full layer's selection). Shared and
  full layers keep different cache specs, so they form two cache groups. MTP layers run their own.

Parity with transformers: tests/test_dsa_parity.py, MTP tests/test_dsa_mtp.py.
"""

from __future__ import annotations

from transformers import GlmMoeDsaConfig

from models.deepseek_v3_2.model import DeepseekV32DecoderLayer, DeepseekV32ForCausalLM, DeepseekV32Model
from module.mtp import MTPLayerMixin


class GlmMoeDsaDecoderLayer(DeepseekV32DecoderLayer):
    @staticmethod
    def runs_indexer(config: GlmMoeDsaConfig, layer_index: int) -> bool:
        if layer_index < len(config.indexer_types):
            return config.indexer_types[layer_index] == "full"
        return True

    @staticmethod
    def interleaved_indexer_rope(config: GlmMoeDsaConfig) -> bool:
        return getattr(config, "indexer_rope_interleave", True)


class GlmMoeDsaMTPLayer(MTPLayerMixin, GlmMoeDsaDecoderLayer):
    """One MTP module on a GLM-5 decoder layer, with an indexer of its own."""


class GlmMoeDsaModel(DeepseekV32Model):
    decoder_layer_cls = GlmMoeDsaDecoderLayer
    mtp_layer_cls = GlmMoeDsaMTPLayer


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    base_model_cls = GlmMoeDsaModel
    family = "GLM-5"

    @staticmethod
    def check_config(config: GlmMoeDsaConfig) -> None:
        """DeepSeek-V3's routing check, and a first layer that selects: a shared layer reuses one before it."""
        DeepseekV32ForCausalLM.check_config(config)
        if config.indexer_types and config.indexer_types[0] != "full":
            raise ValueError(f"config indexer_types[0] {config.indexer_types[0]!r}: the first layer must be 'full'")
