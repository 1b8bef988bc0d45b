"""CommManager: every process group of a run, created once at start from parallel_config.

Model groups (on the platform's backend: gloo on CPU, nccl on CUDA, hccl on NPU) go to the layers as
a ModelParallel, each marked when its ranks hold different tokens (across data-parallel replicas, or
context parallel's shares); the gloo groups carry Python objects and flags: the world (KV block
counts; in lock-step, whether anyone still has work and how many proposer forwards a step runs),
each replica's ranks (an attention TP group, times the context-parallel ranks: agreeing to stop
after a step; its first rank's speculative drafts) and the DP leaders (gathering the replicas'
results). The o_proj TP and attention DP groups of the layout are not created: no layer
here splits o_proj other than with the attention heads, and the DP replicas talk through their
leaders, the world group and the model groups that span them (lock-step, docs/distributed.md). All
ranks call new_group for every group in the same order, as torch.distributed requires; groups with
the same ranks and backend are created once and shared. Every collective has the run's timeout, so a
rank that is gone turns into an error within it, never a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from executor.core.config.errors import ConfigError
from executor.core.config.parallel_layout import ParallelLayout
from module.parallel_group import CommStats, ModelParallel, ParallelGroup

CPU_BACKEND = "gloo"
MODEL_KINDS = ("attn_tp", "dense_tp", "moe_tp", "moe_ep", "embed_tp", "lmhead_tp", "cp")


@dataclass(frozen=True, slots=True)
class DistEnv:
    """This process's place as torchrun describes it (RANK, WORLD_SIZE, LOCAL_RANK); one process without it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls) -> DistEnv:
        if "RANK" not in os.environ:
            return cls()
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def launch_problem(world_size: int, env: DistEnv) -> str | None:
    """Why this process cannot be a rank of a world_size run, or None."""
    if world_size == env.world_size:
        return None
    launched = f"torchrun started {env.world_size} processes" if env.world_size > 1 else "it runs in one process"
    return (
        f"parallel_config.world_size is {world_size} but {launched}: launch through infer.sh or "
        "`python -m executor.offline.launch` (torchrun --nproc-per-node <world_size> under the hood)"
    )


class CommManager:
    def __init__(self, layout: ParallelLayout, env: DistEnv, backend: str, timeout_s: float) -> None:
        problem = launch_problem(layout.world_size, env)
        if problem is not None:
            raise ConfigError(problem)
        self.layout = layout
        self.env = env
        self.rank = env.rank
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stats = CommStats()
        self._handles: dict[tuple[tuple[int, ...], str], Any] = {}
        self.groups: dict[str, ParallelGroup] = {kind: ParallelGroup(kind) for kind in MODEL_KINDS}
        self.world_cpu: Any = None
        self.tp_cpu: Any = None
        self.dp_leaders_cpu: Any = None
        if env.world_size == 1:
            return
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=self.timeout)
        for kind in MODEL_KINDS:
            self.groups[kind] = self._create(kind, backend)
        self.world_cpu = self._handle(list(range(env.world_size)), CPU_BACKEND)
        self.tp_cpu = self._create_cpu("replica")
        self.dp_leaders_cpu = self._create_cpu("dp_leaders")

    @property
    def is_distributed(self) -> bool:
        return self.env.world_size > 1

    def _handle(self, ranks: list[int], backend: str) -> Any:
        key = (tuple(ranks), backend)
        if key not in self._handles:
            if len(ranks) == dist.get_world_size() and backend == dist.get_backend():
                self._handles[key] = dist.group.WORLD
            else:
                self._handles[key] = dist.new_group(ranks, timeout=self.timeout, backend=backend)
        return self._handles[key]

    def _create(self, kind: str, backend: str) -> ParallelGroup:
        """This rank's group of `kind` (every rank is in one group of each model kind)."""
        size = self.layout.size_of(kind)
        if size == 1:
            return ParallelGroup(kind)
        handle = self._create_cpu(kind, backend)
        rank = self.layout.group_rank(kind, self.rank)
        spans = self.layout.holds_different_tokens(kind)
        return ParallelGroup(kind, rank, size, handle, self.stats, spans_replicas=spans)

    def _create_cpu(self, kind: str, backend: str = CPU_BACKEND) -> Any:
        """Every group of `kind` created (as all ranks must); the handle of this rank's, or None."""
        mine = None
        for ranks in self.layout.groups(kind):
            handle = self._handle(ranks, backend)
            if self.rank in ranks:
                mine = handle
        return mine

    def model_parallel(self) -> ModelParallel:
        """The groups the model's layers are built with."""
        return ModelParallel(**self.groups)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def is_dp_leader(self) -> bool:
        """The first rank of its replica (attention TP rank 0, CP rank 0): it speaks for its
        data-parallel replica."""
        return self.rank % self.layout.replica_size == 0

    def min_over_world(self, value: int) -> int:
        """The smallest `value` over all ranks (KV block counts: every rank must size the same pool)."""
        return self._reduce_over_world([value], dist.ReduceOp.MIN)[0]

    def max_over_world(self, value: int) -> int:
        """The largest `value` over all ranks (in lock-step: the proposer forwards every replica runs in a step)."""
        return self._reduce_over_world([value], dist.ReduceOp.MAX)[0]

    def max_each_over_world(self, values: list[int]) -> list[int]:
        """The largest of each of `values` over all ranks, in one all-reduce (in lock-step with graphs:
        a step's rows and tokens per row, which pick every rank's bucket)."""
        return self._reduce_over_world(values, dist.ReduceOp.MAX)

    def _reduce_over_world(self, values: list[int], op: Any) -> list[int]:
        if not self.is_distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=op, group=self.world_cpu)
        return tensor.tolist()

    def share_in_replica(self, rows: list[list[int]], width: int) -> list[list[int]]:
        """`rows` (each of at most `width` ids >= 0) as this attention TP group's rank 0 holds them,
        on every rank of the group: one gloo broadcast of a [rows, width] table padded with -1.
        Every rank of the group passes as many rows (they run the same batch)."""
        if self.layout.attn_tp_size == 1 or not rows:
            return rows
        table = torch.full((len(rows), width), -1, dtype=torch.int64)
        for index, row in enumerate(rows):
            table[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
        dist.broadcast(table, group=self.tp_cpu, group_src=0)
        return [[token for token in row if token >= 0] for row in table.tolist()]

    def graph_key_settings(self) -> dict[str, object]:
        """What a compiled graph of this rank depends on beyond the model: its rank (its shard: which
        experts, which vocabulary rows) and the model groups its collectives name; empty in one process."""
        if not self.is_distributed:
            return {}
        names = {kind: group.group.group_name for kind, group in self.groups.items() if group.group is not None}
        return {"rank": self.rank, "layout": self.layout, "groups": names}

    def any_in_replica(self, flag: bool) -> bool:
        """Whether any rank of this replica (attention TP group, times the CP ranks) says so: its
        ranks run the same steps, so they must stop after the same one."""
        if self.layout.replica_size == 1:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.tp_cpu)
        return bool(tensor.item())

    def agree_over_world(self, has_work: bool, stop: bool) -> tuple[bool, bool]:
        """Lock-step data parallelism, before each step: whether any rank still has work, and whether
        any says stop (one MAX over the world's gloo group, with the collective timeout)."""
        if not self.is_distributed:
            return has_work, stop
        tensor = torch.tensor([int(has_work), int(stop)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.world_cpu)
        anyone_has_work, anyone_stops = tensor.tolist()
        return bool(anyone_has_work), bool(anyone_stops)

    def broadcast_from_rank0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the online loop's turn: what arrived over HTTP)."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.world_cpu)
        return box[0]

    def gather_to_rank0(self, obj: Any) -> list[Any] | None:
        """On rank 0, every rank's `obj` in rank order; None on the other ranks."""
        if not self.is_distributed:
            return [obj]
        gathered: list[Any] | None = [None] * self.env.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self.world_cpu)
        return gathered

    def gather_from_dp_leaders(self, obj: Any) -> list[Any] | None:
        """On rank 0, every DP leader's `obj` in DP-rank order; None on the other ranks. Only the
        leaders call it (their replicas' other ranks hold the same results)."""
        assert self.is_dp_leader
        if self.layout.attn_dp_size == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.layout.attn_dp_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self.dp_leaders_cpu)
        return gathered

    def close(self) -> None:
        """Destroy the process groups and let go of every handle to them (this manager's, and its
        ParallelGroups', which the model's layers share), so that they end here, while the
        interpreter is whole. destroy_process_group only forgets the groups (a gloo backend's
        shutdown does nothing): a ProcessGroupGloo's worker threads are joined by its destructor,
        which runs (GIL released) when the last reference goes. A worker may still be releasing the
        last collective's tensors after the rank has moved on, and releasing a tensor that has a
        Python object takes the GIL; if the interpreter is already finalizing by then, Python ends
        that thread with pthread_exit inside the work's noexcept destructor: std::terminate, and a
        rank that finished its run dies with SIGABRT ("terminate called without an active
        exception")."""
        if not self.is_distributed:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        for group in self.groups.values():
            group.release()
        self._handles.clear()
        self.world_cpu = self.tp_cpu = self.dp_leaders_cpu = None
