"""DeepSeek-V4's rotary embedding: on the trailing rope dims of a head ([nope | rope]), rotating
consecutive pairs (x0, x1), (x2, x3), ... (interleaved), with two frequency sets: "main" for the
sliding-window layers and "compress" (its own theta, yarn where configured) for the compressed
layers, their compressors and the indexer. Frequencies are transformers' own (its
DeepseekV4RotaryEmbedding), and cos/sin are computed per step from the positions as it does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

ROPE_KINDS = ("main", "compress")


class InterleavedRope(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        reference = DeepseekV4RotaryEmbedding(config)
        self.attention_scaling = {}
        for kind in ROPE_KINDS:
            self.register_buffer(f"{kind}_inv_freq", getattr(reference, f"{kind}_inv_freq").float(), persistent=False)
            self.attention_scaling[kind] = getattr(reference, f"{kind}_attention_scaling")

    def forward(self, positions: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, sin) [..., rope_dim / 2] in `dtype`, one per pair."""
        freqs = positions[..., None].float() * getattr(self, f"{kind}_inv_freq")
        scaling = self.attention_scaling[kind]
        return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with cos/sin [T, R / 2]: the last R dims rotated pairwise (in fp32), the rest kept."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)
