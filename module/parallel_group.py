"""The process groups a model's layers communicate over, handed to each layer when it is built.

A layer never reaches for torch.distributed's default group: it holds the ParallelGroup of its kind
(attention TP, dense FFN TP, MoE TP and EP, embedding TP, LM-head TP), built once by CommManager
(executor/core/config/comm_manager.py). Every collective goes through the group, which counts the
bytes it hands over, so the step log can say what each collective cost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CommStats:
    """Bytes this rank handed to each collective ("<group>.<op>" -> bytes) since the last take()."""

    bytes_by_collective: Counter[str] = field(default_factory=Counter)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.bytes_by_collective[key] += tensor.numel() * tensor.element_size()

    def take(self) -> dict[str, int]:
        """The counts so far, and reset (one step's worth, read by the scheduler after each step)."""
        counts = dict(self.bytes_by_collective)
        self.bytes_by_collective.clear()
        return counts


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """This rank's place in one group: rank and size within it, and the process group (None when
    size is 1: nothing to talk to)."""

    name: str = "single"
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup
    stats: CommStats | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"{self.name}: rank {self.rank} outside size {self.size}"

    def _count(self, op: str, tensor: torch.Tensor) -> None:
        assert self.group is not None, f"{self.name} (size {self.size}) has no process group to {op} over"
        if self.stats is not None:
            self.stats.add(f"{self.name}.{op}", tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the group (no-op at size 1)."""
        if self.size > 1:
            self._count("all_reduce", tensor)
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all), concatenated along `dim` in rank order."""
        if self.size == 1:
            return tensor
        self._count("all_gather", tensor)
        shards = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.group)
        return torch.cat(shards, dim=dim)


SINGLE = ParallelGroup()


@dataclass(frozen=True, slots=True)
class ModelParallel:
    """The groups a model is built with, by parallel_config's names; all SINGLE in one process.

    MoE layers hold two: moe_tp splits each expert's intermediate dim, moe_ep splits the experts.
    """

    attn_tp: ParallelGroup = SINGLE
    dense_tp: ParallelGroup = SINGLE
    moe_tp: ParallelGroup = SINGLE
    moe_ep: ParallelGroup = SINGLE
    embed_tp: ParallelGroup = SINGLE
    lmhead_tp: ParallelGroup = SINGLE


ONE_PROCESS = ModelParallel()  # every group SINGLE: the default a model is built with
