"""The plain-torch form of q8_dot_linear.cpp's arithmetic (ops/cpu_quantized.py's int8 rows): each row
quantized to int8 per 32 values as llama.cpp's Q8_1 (d = max|x| / 127, q = x * (1 / d) rounded to
nearest, ties to even), and the dequantized row (q * d) multiplied by the dequantized weight."""

from __future__ import annotations

import torch

BLOCK = 32


def q8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [R, K] (K a multiple of 32) -> (int8 codes [R, K], fp32 block scales d [R, K / 32])."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.round(blocks * inverse[..., None]).to(torch.int8)
    return codes.reshape(x.shape), d


def dequantized_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows as the int8-row kernels multiply them: q * d, in float64."""
    codes, d = q8_blocks(x)
    blocks = codes.double().reshape(*x.shape[:-1], -1, BLOCK) * d.double()[..., None]
    return blocks.reshape(x.shape)
