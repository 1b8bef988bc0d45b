"""Gated activations for MLPs whose gate and up projections are merged into one matmul."""

from __future__ import annotations

import torch
from torch import nn

import ops


class SiluAndMul(nn.Module):
    """[T, 2I] -> [T, I]: silu(gate) * up, gate first (the order of gate_up_proj's shards)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
