"""Tiny random DeepSeek-V3 configs and checkpoints for the DeepSeek-V3 tests (the paged driver they
use is tests/paged_harness.py's)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from models.deepseek_v3 import DeepseekV3ForCausalLM
from tests import paged_harness
from tests.paged_harness import VOCAB, PagedModel, hf_generate, hf_last_logits, random_prompts, single_thread

# The DeepSeek tests import the generic driver from here too.
__all__ = [
    "PagedModel",
    "deepseek_config",
    "hf_generate",
    "hf_last_logits",
    "load_ours",
    "random_hf_model",
    "random_prompts",
    "save_checkpoint",
    "single_thread",
]


def deepseek_config(**overrides: object) -> transformers.DeepseekV3Config:
    """Three layers (the first dense), 8 routed experts in 4 groups, q_lora_rank set, no MTP module;
    overrides change any field."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,  # transformers' eager attention repeats K/V by heads // this
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        max_position_embeddings=128,
        num_nextn_predict_layers=0,
        initializer_range=0.1,  # peaked logits, so greedy choices are far from ties
        bos_token_id=None,
        eos_token_id=None,  # HF generate must not stop early
        pad_token_id=None,
        attn_implementation="eager",
    )
    settings.update(overrides)
    return transformers.DeepseekV3Config(**settings)


def random_hf_model(config: transformers.DeepseekV3Config, seed: int = 0) -> transformers.DeepseekV3ForCausalLM:
    """transformers' model with random weights, including the routers' score-correction biases and
    the linear biases (which transformers initialises to zero)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("bias"):
                tensor.normal_(0.0, 0.1)
    return model


def save_checkpoint(path: Path, config: transformers.DeepseekV3Config, seed: int = 0) -> torch.nn.Module:
    """Write a model folder for `config` (config.json + model.safetensors with DeepSeek's tensor
    names) and return transformers' model with the same weights.

    With config.num_nextn_predict_layers > 0 the folder holds the MTP modules too: their decoder
    blocks are the extra layers of a deeper random transformers model, whose forward runs only the
    first num_hidden_layers (so it is the main model, and model.model.layers[N + i] is MTP module
    i's block), plus random enorm/hnorm/eh_proj/shared_head.norm and each module's copies of the
    embedding and LM head, as released checkpoints carry them.
    """
    num_layers, num_mtp = config.num_hidden_layers, config.num_nextn_predict_layers or 0
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = num_layers + num_mtp
    model = random_hf_model(deeper, seed)
    model.save_pretrained(path)
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
