"""ge_graph's compiler on the CPU: a bucket's graph runs with only the guards that tell the buckets apart.

Dynamo's full guard check cost about 1.1 ms of a 10 ms batch-1 decode step (docs/graph_modes.md);
once every bucket is compiled nothing it guards changes, so the callables skip it. These tests hold
both halves: each bucket still runs its own graph, and a guarded value changed after warm-up neither
recompiles nor is read (the full check would have recompiled).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

from executor.platform.compile_cache import CompileCache
from executor.platform.graph_compilers import GraphOutput, InductorCompiler
from executor.platform.platform import Platform


class Scaled(torch.nn.Module):
    """A step module whose output reads a Python float, which dynamo guards by value."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> GraphOutput:
        return x * self.scale, x.sum(dim=-1, keepdim=True)


@dataclass
class Buffers:
    x: torch.Tensor

    def forward_args(self) -> tuple[object, ...]:
        return (self.x,)


@pytest.fixture
def compiler(monkeypatch) -> InductorCompiler:
    monkeypatch.setattr(InductorCompiler, "inductor_options", lambda self: {})  # a quick compile
    return InductorCompiler(Platform("cpu", torch.device("cpu")), CompileCache(None), num_buckets=2)


def test_each_bucket_runs_its_own_graph_without_the_full_guard_check(compiler):
    step = Scaled()
    buckets = {rows: Buffers(torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)) for rows in (1, 4)}
    graphs = {rows: compiler.compile(step, buffers, f"{rows}") for rows, buffers in buckets.items()}
    compiled = counters["stats"]["unique_graphs"]

    step.scale = 3.0  # what the full guard check would recompile on
    for rows, buffers in buckets.items():
        buffers.x.add_(1.0)
        scaled, sums = graphs[rows](buffers)
        assert scaled.shape == (rows, 3)
        torch.testing.assert_close(scaled, buffers.x * 2.0)  # the bucket's graph, as compiled
        torch.testing.assert_close(sums, buffers.x.sum(dim=-1, keepdim=True))
    assert counters["stats"]["unique_graphs"] == compiled
