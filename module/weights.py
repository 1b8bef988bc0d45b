"""Copying checkpoint tensors into (sharded) parameters with shape checks that name both shapes."""

from __future__ import annotations

import torch
from torch import nn

from executor.model_loader.errors import WeightLoadError

# Which part of a fused parameter a checkpoint tensor fills: "q"/"k"/"v", a merged index, or None.
ShardId = int | str | None


def load_shard(
    destination: torch.Tensor, loaded_weight: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int
) -> None:
    """Copy rank `tp_rank`'s slice of `loaded_weight` along `dim` (None: replicated) into destination."""
    expected = list(destination.shape)
    if dim is not None:
        expected[dim] *= tp_size
    if list(loaded_weight.shape) != expected:
        raise WeightLoadError(f"shape mismatch: expected {tuple(expected)}, got {tuple(loaded_weight.shape)}")
    if dim is not None:
        size = destination.shape[dim]
        loaded_weight = loaded_weight.narrow(dim, tp_rank * size, size)
    destination.copy_(loaded_weight)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
    """For parameters that every rank holds whole (norm weights)."""
    load_shard(param.data, loaded_weight, None, 0, 1)
