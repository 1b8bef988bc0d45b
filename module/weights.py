"""Copying checkpoint tensors into (sharded) parameters with shape checks that name both shapes.

A loader may hand over a CheckpointTensor (executor/types_/checkpoint_tensor.py) instead of a
torch.Tensor: load_shard narrows it before reading, so a tensor-parallel rank reads only its shard of
each tensor from the file, and an expert-parallel rank never reads another rank's experts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import torch
from torch import nn

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError

# Which part of a fused parameter a checkpoint tensor fills: "q"/"k"/"v", a merged index, or None.
ShardId = int | str | None
# A parameter's `weight_loader(param, loaded_weight, shard_id=None)`: bound methods and partials too.
WeightLoader = Callable[..., None]
# The attribute the model loaders call a parameter's loader by (load_fused_tensor); torch's
# Parameter does not declare it, so it is set by name (set_weight_loader).
WEIGHT_LOADER = "weight_loader"


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Give `param` the loader that cuts this rank's part of a checkpoint tensor into it."""
    setattr(param, WEIGHT_LOADER, loader)


def load_shard(
    destination: torch.Tensor, loaded_weight: LoadedWeight, dim: int | None, tp_rank: int, tp_size: int
) -> None:
    """Copy rank `tp_rank`'s slice of `loaded_weight` along `dim` (None: replicated) into destination,
    reading only that slice when `loaded_weight` is still in the checkpoint; the copy converts to
    destination's dtype."""
    expected = list(destination.shape)
    if dim is not None:
        expected[dim] *= tp_size
    if list(loaded_weight.shape) != expected:
        raise WeightLoadError(f"shape mismatch: expected {tuple(expected)}, got {tuple(loaded_weight.shape)}")
    if dim is not None:
        size = destination.shape[dim]
        loaded_weight = loaded_weight.narrow(dim, tp_rank * size, size)
    destination.copy_(materialize(loaded_weight))


def default_weight_loader(param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
    """For parameters that every rank holds whole (norm weights)."""
    load_shard(param.data, loaded_weight, None, 0, 1)


def fused_parameter_name(
    checkpoint_name: str, packed_modules_mapping: Mapping[str, tuple[str, ShardId]]
) -> tuple[str, ShardId]:
    """The parameter a checkpoint tensor fills and which shard of it: a tensor of a module that
    packed_modules_mapping fuses ("...q_proj.weight" -> ("...qkv_proj.weight", "q")), else itself whole."""
    for checkpoint_module, (fused_module, fused_shard) in packed_modules_mapping.items():
        if f".{checkpoint_module}." in checkpoint_name:
            return checkpoint_name.replace(f".{checkpoint_module}.", f".{fused_module}."), fused_shard
    return checkpoint_name, None


def load_fused_tensor(
    model: nn.Module,
    checkpoint_name: str,
    tensor: LoadedWeight,
    params: Mapping[str, nn.Parameter],
    packed_modules_mapping: Mapping[str, tuple[str, ShardId]],
) -> tuple[str, ShardId]:
    """Copy one checkpoint tensor into its (possibly fused) parameter of `model` with the parameter's
    weight_loader; -> (parameter name, which shard it was). An unknown name raises WeightLoadError."""
    name, shard_id = fused_parameter_name(checkpoint_name, packed_modules_mapping)
    param = params.get(name)
    if param is None:
        raise WeightLoadError(f"unexpected: {type(model).__name__} has no parameter {name!r}")
    getattr(param, WEIGHT_LOADER, default_weight_loader)(param, tensor, shard_id)
    return name, shard_id


def fused_shards_needed(name: str, packed_modules_mapping: Mapping[str, tuple[str, ShardId]]) -> int:
    """How many checkpoint tensors fill parameter `name` ("<prefix>.<module>.<weight|bias>"): one per
    part for a module that packed_modules_mapping fuses, else one."""
    return Counter(module for module, _ in packed_modules_mapping.values()).get(name.split(".")[-2], 1)
