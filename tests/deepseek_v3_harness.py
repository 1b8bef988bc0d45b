"""Tiny random DeepSeek-V3 checkpoints for the DeepSeek-V3 tests (their config is
tests/factories.py's deepseek_config; the paged driver, the random model and the checks they use
are tests/paged_harness.py's)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from models.deepseek_v3 import DeepseekV3ForCausalLM
from tests import paged_harness
from tests.paged_harness import save_random_model

# Per-layer lists of a config (DeepSeek-V3.2's and GLM-5's) and what an MTP layer past them is.
MTP_LAYER_TYPES = {"mlp_layer_types": "sparse", "layer_types": "indexed_attention", "indexer_types": "full"}


def save_checkpoint(
    path: Path,
    config: transformers.PretrainedConfig,
    seed: int = 0,
    hf_model_cls: type[transformers.PreTrainedModel] = transformers.DeepseekV3ForCausalLM,
) -> torch.nn.Module:
    """Write a model folder for `config` (config.json + model.safetensors with DeepSeek's tensor
    names) and return transformers' model (`hf_model_cls`) with the same weights: random, with the routers'
    score-correction biases and the linear biases (which transformers initialises to zero) drawn too.

    With config.num_nextn_predict_layers > 0 the folder holds the MTP modules too: their decoder
    blocks are the extra layers of a deeper random transformers model, whose forward runs only the
    first num_hidden_layers (so it is the main model, and model.model.layers[N + i] is MTP module
    i's block), plus random enorm/hnorm/eh_proj/shared_head.norm and each module's copies of the
    embedding and LM head, as released checkpoints carry them.
    """
    num_layers, num_mtp = config.num_hidden_layers, config.num_nextn_predict_layers or 0
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = num_layers + num_mtp
    for key, mtp_type in MTP_LAYER_TYPES.items():
        if getattr(deeper, key, None) is not None:
            setattr(deeper, key, list(getattr(deeper, key)) + [mtp_type] * num_mtp)
    model = save_random_model(path, hf_model_cls, deeper, seed, redraw={"bias": (0.0, 0.1)})
    model.config.num_hidden_layers = num_layers
    tensors = load_file(str(path / "model.safetensors"))
    hidden = config.hidden_size
    for index in range(num_layers, num_layers + num_mtp):
        prefix = f"model.layers.{index}."
        tensors |= {
            prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
            prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
            prefix + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return model


def load_ours(path: Path, config: transformers.DeepseekV3Config) -> DeepseekV3ForCausalLM:
    return paged_harness.load_ours(DeepseekV3ForCausalLM, path, config)
