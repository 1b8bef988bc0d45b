"""The process groups a model's layers communicate over, handed to each layer when it is built.

A layer never reaches for torch.distributed's default group: it holds the ParallelGroup of its kind
(attention TP, dense FFN TP, MoE TP and EP, embedding TP, LM-head TP), built once by CommManager
(executor/core/config/comm_manager.py). Every collective goes through the group, which counts the
bytes it hands over, so the step log can say what each collective cost.

A group may span data-parallel replicas (cann-recipes' attention DP with a wider MoE EP or embedding
TP), or split a context-parallel step's tokens: its ranks then hold different tokens, and a layer
first gathers them (gather_rows), runs on all of them, and keeps its own rows. The replicas step in
lock-step so that these collectives meet (docs/distributed.md).

Inside a graph (traced by dynamo or torch.export, or captured on a CUDA stream) the collectives are
c10d's functional ones, which the compilers trace, and gather_rows cannot read the counts on the
host: there every rank of the group holds the same number of rows (the graph runner's bucket, agreed
by the replicas of a lock-step group), padding included, and the gather takes them all.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


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
    # its ranks hold different tokens (they serve different DP replicas, or shares of a context-parallel step)
    spans_replicas: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"{self.name}: rank {self.rank} outside size {self.size}"

    def release(self) -> None:
        """Let go of the process group once it is destroyed (CommManager.close): the layers share
        this object, so its handle must go here for the group's last reference to go; a collective
        after that fails on the assertion in _count."""
        object.__setattr__(self, "group", None)  # frozen for the layers; cleared once, at teardown

    def _count(self, op: str, tensor: torch.Tensor) -> None:
        """Add the bytes to the step's count, outside graphs only: a graph runs no Python, and under
        dynamo the count would be a side effect guarded on the counter's values (a recompile)."""
        assert self.group is not None, f"{self.name} (size {self.size}) has no process group to {op} over"
        if self.stats is not None and not torch.compiler.is_compiling():
            self.stats.add(f"{self.name}.{op}", tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the group (in place outside graphs; `tensor` at size 1)."""
        if self.size > 1:
            self._count("all_reduce", tensor)
            if torch.compiler.is_compiling():
                return funcol.all_reduce(tensor, "sum", self.group)
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all), concatenated along `dim` in rank order."""
        if self.size == 1:
            return tensor
        self._count("all_gather", tensor)
        return self._all_gather(tensor, dim)

    def _all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return funcol.all_gather_tensor(tensor.contiguous(), dim % tensor.dim(), self.group)
        shards = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.group)
        return torch.cat(shards, dim=dim)

    def gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """Every rank's rows (dim 0; the counts may differ) concatenated in rank order, the same on
        every rank, and the slice where this rank's own rows lie in it. The counts are exchanged
        first (one host read), then each rank's rows padded to the largest count are all-gathered;
        both count under "<group>.gather_rows". Inside a graph every rank holds the same count
        (module docstring): no exchange, all rows gathered, nothing counted."""
        own_count = tensor.shape[0]
        if self.size == 1:
            return tensor, slice(0, own_count)
        if in_graph(tensor):
            return self._all_gather(tensor, 0), slice(self.rank * own_count, (self.rank + 1) * own_count)
        count = torch.tensor([own_count], dtype=torch.int64, device=tensor.device)
        self._count("gather_rows", count)
        count_shards = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(count_shards, count, group=self.group)
        counts = torch.cat(count_shards).tolist()
        start = sum(counts[: self.rank])
        own = slice(start, start + own_count)
        max_count = max(counts)
        if max_count == 0:
            return tensor, own
        padded = tensor.contiguous()
        if own_count < max_count:
            padded = tensor.new_zeros((max_count, *tensor.shape[1:]))
            padded[:own_count] = tensor
        self._count("gather_rows", padded)
        shards = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(shards, padded, group=self.group)
        return torch.cat([shard[:n] for shard, n in zip(shards, counts, strict=True)]), own


def in_graph(tensor: torch.Tensor) -> bool:
    """Whether the code runs inside a graph being made: traced by dynamo or torch.export, or captured
    on the CUDA stream `tensor` lives on; its shapes are then fixed and no host read may happen."""
    return torch.compiler.is_compiling() or (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


SINGLE = ParallelGroup()


@dataclass(frozen=True, slots=True)
class ModelParallel:
    """The groups a model is built with, by parallel_config's names; all SINGLE in one process.

    MoE layers hold two: moe_tp splits each expert's intermediate dim, moe_ep splits the experts.
    cp is the context-parallel group, over which the runner splits a step's tokens (no layer holds it).
    """

    attn_tp: ParallelGroup = SINGLE
    dense_tp: ParallelGroup = SINGLE
    moe_tp: ParallelGroup = SINGLE
    moe_ep: ParallelGroup = SINGLE
    embed_tp: ParallelGroup = SINGLE
    lmhead_tp: ParallelGroup = SINGLE
    cp: ParallelGroup = SINGLE


ONE_PROCESS = ModelParallel()  # every group SINGLE: the default a model is built with
