"""Tiny random LongCat-Flash checkpoints for the LongCat-Flash tests (their config is
tests/factories.py's longcat_flash_config; the paged driver and the checks are tests/paged_harness.py's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMLA, LongcatFlashMLP

from models.longcat_flash import LongcatFlashForCausalLM
from tests import paged_harness
from tests.paged_harness import save_random_model


@dataclass(slots=True)
class MTPReference:
    """LongCat's MTP module as the checkpoint holds it: transformers' MLA and MLP classes for its
    block (their names are the checkpoint's), and the other tensors by their checkpoint names."""

    attention: LongcatFlashMLA
    mlp: LongcatFlashMLP
    tensors: dict[str, torch.Tensor]


def save_checkpoint(path: Path, config: transformers.LongcatFlashConfig, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` and transformers' model with its weights: random, the linear
    biases, norm weights and the router's score-correction bias (constants from transformers) drawn
    too, the bias wide enough to change which experts win."""
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1), "e_score_correction_bias": (0.0, 0.05)}
    return save_random_model(path, transformers.LongcatFlashForCausalLM, config, seed, redraw=redraw)


def add_mtp_module(path: Path, config: transformers.LongcatFlashConfig, seed: int = 1) -> MTPReference:
    """Add one random MTP module to the checkpoint at `path`, under LongCat's names (model.mtp.*: its
    own embedding, enorm.m / hnorm.m, eh_proj, the block's self_attn, norms and transformer_layer.mlp,
    the final norm), and set num_nextn_predict_layers 1 in its config.json."""
    torch.manual_seed(seed)
    hidden = config.hidden_size
    attention, mlp = LongcatFlashMLA(config, layer_idx=0).eval(), LongcatFlashMLP(config).eval()
    with torch.no_grad():
        for name, param in attention.named_parameters():
            if "layernorm" in name:
                param.normal_(1.0, 0.1)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden)

    prefix = "model.mtp.layers.0."
    tensors = {
        "model.mtp.embed_tokens.weight": config.initializer_range * torch.randn(config.vocab_size, hidden),
        "model.mtp.norm.weight": norm(),
        prefix + "enorm.m.weight": norm(),
        prefix + "hnorm.m.weight": norm(),
        prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
        prefix + "input_layernorm.weight": norm(),
        prefix + "post_attention_layernorm.weight": norm(),
    }
    block = {f"{prefix}self_attn.{name}": value for name, value in attention.state_dict().items()}
    block |= {f"{prefix}transformer_layer.mlp.{name}": value for name, value in mlp.state_dict().items()}
    checkpoint = load_file(str(path / "model.safetensors"))
    save_file(checkpoint | tensors | block, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.num_nextn_predict_layers = 1
    config.save_pretrained(path)
    return MTPReference(attention, mlp, tensors)


def load_ours(path: Path, config: transformers.LongcatFlashConfig) -> LongcatFlashForCausalLM:
    return paged_harness.load_ours(LongcatFlashForCausalLM, path, config)
