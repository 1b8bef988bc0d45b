"""Decode steps as graphs: one compiled or captured callable per bucket, fed through persistent buffers.

Where cann-recipes has `compile_model`. Prefill (and any step that is not decode-shaped) stays eager,
as there. A decode step of n rows is padded to the smallest bucket holding n (padding rows write only
the null block's slot 0 and are never sampled), its inputs are copied into that bucket's buffers,
allocated once, and the bucket's callable runs on them. Steps that fit no bucket run eagerly; the log
says why, once per reason.

In lock-step data parallelism (docs/distributed.md) the replicas' graphs gather each other's rows,
so every rank must run the same bucket's graph or every rank the eager step: before each step they
agree on the largest decode step of any replica (a MAX over the world), and that picks everyone's
bucket; a replica's prefill makes the step eager everywhere. An idle forward joins as a step of one row.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.platform.graph_compilers import GraphCallable, GraphCompiler, GraphOutput
from executor.types_.model_inputs import ModelInputs, StepLayout
from executor.utils.graph_buckets import pick_bucket
from executor.utils.slow_phase import announced_if_slow
from executor.utils.step_timer import StepTimer
from executor.utils.tensor_tree import map_tensors, same_structure, tensor_leaves
from ops.attention_metadata import AttentionMetadataBuilder, build_model_inputs

logger = logging.getLogger(__name__)

NOT_DECODE = sys.maxsize  # the rows a step that no graph serves asks for in the lock-step agreement


def copy_step(destination: ModelInputs, source: ModelInputs) -> None:
    """Copy a step's inputs into a bucket's buffers (asynchronously from pinned memory); anything
    but tensor values that differs would leave the graph running on stale inputs."""
    if not same_structure(destination.forward_args(), source.forward_args()):
        raise ValueError("a step's inputs do not have the shape of the bucket's buffers")
    for dst, src in zip(tensor_leaves(destination.forward_args()), tensor_leaves(source.forward_args()), strict=True):
        dst.copy_(src, non_blocking=True)


def pinned_like(inputs: ModelInputs) -> ModelInputs:
    """A host mirror of `inputs` in pinned memory, for asynchronous copies to the device."""
    return map_tensors(inputs, lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True))


class DecodeStep(torch.nn.Module):
    """What a bucket's graph holds: the model's forward and, since a decode step samples every row,
    the LM head over all rows (padding rows' logits are computed and never read), so that the
    largest single GEMM of a small model's step is compiled with the rest."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: object) -> GraphOutput:
        hidden_states = self.model(input_ids, positions, forward_metadata)
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        return hidden_states, self.model.compute_logits(hidden_states, rows)


@dataclass(slots=True)
class BucketGraph:
    """One bucket: its persistent input buffers and the callable that runs the model on them."""

    num_rows: int
    buffers: ModelInputs  # on the device, read by `run`; logits_indices is never read
    staging: ModelInputs | None  # pinned host mirror where the device is asynchronous
    run: GraphCallable
    warm_up_s: float


class GraphRunner:
    """Owns the buckets' graphs and buffers; `forward` serves a decode step or says it cannot."""

    def __init__(
        self,
        model: torch.nn.Module,
        compiler: GraphCompiler,
        buckets: list[int],
        device_builder: AttentionMetadataBuilder,
        host_builder: AttentionMetadataBuilder,
        *,
        num_cache_groups: int,
        max_blocks_per_request: int,
        pin_host_buffers: bool,
        step_timer: StepTimer | None = None,
        state_groups: tuple[int, ...] = (),
        agree_rows: Callable[[int], int] | None = None,
    ) -> None:
        """`state_groups`: the recurrent cache groups, whose padded rows read and write the null state slot.
        `agree_rows`: in lock-step, the largest of every rank's rows (a collective every rank calls
        at every step); None where the ranks that share graphs run the same steps anyway."""
        self.step = DecodeStep(model)
        self.step_timer = step_timer if step_timer is not None else StepTimer()  # marks the end of h2d
        self.compiler = compiler
        self.buckets = sorted(buckets)
        self.device_builder = device_builder
        self.host_builder = host_builder
        self.num_cache_groups = num_cache_groups
        self.max_blocks_per_request = max_blocks_per_request
        self.state_groups = state_groups
        self.pin_host_buffers = pin_host_buffers
        self.agree_rows = agree_rows
        self.graphs: dict[int, BucketGraph] = {}
        self.eager_reasons_logged: set[str] = set()
        self.steps_per_bucket: Counter[int] = Counter()
        self.eager_steps = 0  # prefills and decode steps that fit no bucket
        self.warm_up_s = 0.0

    def warm_up(self) -> float:
        """Compile or capture every bucket, largest first (so a shared memory pool is sized by the
        largest one); returns the total seconds."""
        total_start = time.perf_counter()
        for index, num_rows in enumerate(sorted(self.buckets, reverse=True), start=1):
            layout = StepLayout.padding(num_rows, self.num_cache_groups, self.max_blocks_per_request, self.state_groups)
            buffers = build_model_inputs(layout, self.device_builder)
            start = time.perf_counter()
            doing = f"{self.compiler.name}: making bucket {num_rows} ({index} of {len(self.buckets)})"
            with announced_if_slow(logger, doing):
                run = self.compiler.compile(self.step, buffers, num_rows)
                run(buffers)  # the first call compiles where compiling is lazy
                self.compiler.synchronize()
            elapsed = time.perf_counter() - start
            staging = pinned_like(buffers) if self.pin_host_buffers else None
            self.graphs[num_rows] = BucketGraph(num_rows, buffers, staging, run, elapsed)
            logger.info("%s: bucket %d ready in %.1f s (%s)", self.compiler.name, num_rows, elapsed, run.origin)
        self.warm_up_s = time.perf_counter() - total_start
        logger.info(
            "%s: %d buckets %s warmed up in %.1f s", self.compiler.name, len(self.buckets), self.buckets, self.warm_up_s
        )
        return self.warm_up_s

    def stats(self) -> dict[str, object]:
        """For the run summary: how each bucket was made, what ran as a graph and what did not."""
        return {
            "compiler": self.compiler.name,
            "buckets": self.buckets,
            "warm_up_s": self.warm_up_s,
            "bucket_origins": {str(bucket): graph.run.origin for bucket, graph in sorted(self.graphs.items())},
            "graph_steps_per_bucket": {str(bucket): n for bucket, n in sorted(self.steps_per_bucket.items())},
            "eager_steps": self.eager_steps,
        }

    def forward(self, layout: StepLayout) -> GraphOutput | None:
        """Hidden states [bucket rows, hidden] and logits [bucket rows, vocab] of a decode step (rows
        past the layout's are padding), or None when the step must run eagerly."""
        bucket = self._bucket_for(layout)
        if bucket is None:
            self.eager_steps += 1
            return None
        graph = self.graphs[bucket]
        fresh = build_model_inputs(layout.pad_to(bucket), self.host_builder)
        if graph.staging is not None:
            copy_step(graph.staging, fresh)
            fresh = graph.staging
        copy_step(graph.buffers, fresh)
        self.step_timer.mark("h2d")
        self.steps_per_bucket[bucket] += 1
        return graph.run(graph.buffers)

    def _bucket_for(self, layout: StepLayout) -> int | None:
        # prefill and verify steps run eagerly, as in cann-recipes; nothing to log
        num_rows = layout.num_rows if layout.max_query_len == 1 else NOT_DECODE
        if self.agree_rows is not None:
            num_rows = self.agree_rows(num_rows)
        if num_rows == NOT_DECODE:
            return None
        bucket = pick_bucket(num_rows, self.buckets)
        if bucket is None:
            self._log_eager_once(
                f"a decode step of {num_rows} rows fits no graph bucket (largest {self.buckets[-1]}); "
                "steps this large run eagerly (scheduler_config.graph_buckets)"
            )
        return bucket

    def _log_eager_once(self, reason: str) -> None:
        if reason not in self.eager_reasons_logged:
            self.eager_reasons_logged.add(reason)
            logger.warning(reason)
