"""Rotary position embedding with the frequencies (and rope scaling) computed by transformers itself,
so every static rope_type (default, linear, llama3, yarn, ...) matches HF, and a cos/sin table looked up
by position instead of recomputed each step. Models look it up once per step for all layers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def rope_inv_freq(
    config: PretrainedConfig, head_dim: int | None = None, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] fp32, attention_scaling) for the config's rope_type; with `layer_type`,
    for the rope_parameters of that kind of layer (configs that nest them by layer type, as Gemma 4's),
    over the head_dim of `config` (that layer type's config). A default rope with a
    partial_rotary_factor < 1 covers int(head_dim x factor) dims only."""
    parameters = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = parameters["rope_type"]
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(
            f"rope_type {rope_type!r} changes its frequencies with the sequence length, which a "
            "precomputed cos/sin table cannot follow; it is not supported"
        )
    factor = parameters.get("partial_rotary_factor", 1.0)
    if rope_type == "default" and (layer_type is not None or (factor != 1.0 and head_dim is not None)):
        head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * factor)
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (parameters["rope_theta"] ** exponents), 1.0
    if rope_type == "default":
        # typed for LlamaConfig, it reads only the rope fields every config has
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)  # type: ignore[arg-type]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
    if layer_type is None:
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=layer_type)


class RotaryEmbedding(nn.Module):
    """The table of rope_inv_freq(config, head_dim, layer_type), or of `frequencies` (inv_freq,
    attention_scaling) where a family has transformers compute them otherwise. `partial`: the model
    rotates the first rotary_dim dims of each head only (and says so); else rope must cover the whole head."""

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer)

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        partial: bool = False,
        frequencies: tuple[torch.Tensor, float] | None = None,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = frequencies or rope_inv_freq(config, head_dim, layer_type)
        self.rotary_dim = 2 * inv_freq.numel()
        if self.rotary_dim > head_dim or (self.rotary_dim != head_dim and not partial):
            raise ValueError(
                f"rope covers {self.rotary_dim} of head_dim {head_dim}: partial rotary is not supported here"
            )
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        # As HF: cos/sin in fp32 times attention_scaling, cast to the activation dtype on use.
        # Only half of each row is stored; HF's emb = cat(freqs, freqs) repeats it.
        cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, rotary_dim] in `dtype`, for ops.apply_rotary."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).chunk(2, dim=-1)
        return cos.repeat(1, 2), sin.repeat(1, 2)
