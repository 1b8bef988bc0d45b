"""Decode and verify steps as graphs: one compiled or captured callable per bucket, fed through persistent buffers.

Where cann-recipes has `compile_model`. As there, every step that is not a prefill runs through a graph:
a decode step of n rows is padded to the smallest bucket holding n (padding rows write only the null
block's slot 0 and are never sampled); with speculative decoding a verify step, whose requests feed
1 + k tokens (cann-recipes' next_n + 1), runs in the bucket of its request count that holds 1 + k
tokens per request, each request's tokens padded to 1 + k (bucket_padding.pad_step). The step's inputs are
copied into that bucket's buffers, allocated once, and the bucket's callable runs on them. Prefills and
steps that fit no bucket run eagerly; the log says why, once per reason. The MTP proposer's decode-shaped
passes run through runners of their own (executor/core/spec_decode/mtp_graphs.py).

In lock-step data parallelism (docs/distributed.md) the replicas' graphs gather each other's rows,
so every rank must run the same bucket's graph or every rank the eager step: before each step they
agree, in one MAX over the world of (rows, tokens per row), on the most rows and the most tokens per
row of any replica's step, and that picks everyone's bucket. A replica whose own step is a decode
step runs it in the agreed verify bucket when another verifies (its one token per request padded to
1 + k); an idle forward joins as a decode step of one row; a replica's prefill, or a step no bucket
holds, makes the step eager everywhere.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from executor.core.model_worker.bucket_padding import pad_step, padded_token_rows, padding_step
from executor.platform.graph_compilers import GraphCallable, GraphCompiler, GraphOutput
from executor.utils.graph_buckets import Bucket, pick_bucket
from executor.utils.slow_phase import announced_if_slow
from executor.utils.tensor_tree import map_tensors, same_structure, tensor_leaves
from ops.attention.metadata import (
    AttentionMetadataBuilder,
    ForwardMetaData,
    ModelInputs,
    StepLayout,
    build_model_inputs,
    put_rows,
    take_rows,
)

logger = logging.getLogger(__name__)

NOT_DECODE = sys.maxsize  # the rows a step that no graph serves asks for in the lock-step agreement

# in lock-step, every rank's [rows, tokens per row] -> the largest of each over the world (a collective
# every rank calls at every step of the runner)
AgreeShape = Callable[[list[int]], list[int]]


def copy_step(destination: ModelInputs, source: ModelInputs) -> None:
    """Copy a step's inputs into a bucket's buffers (asynchronously from pinned memory); anything
    but tensor values that differs would leave the graph running on stale inputs."""
    if not same_structure(destination.forward_args(), source.forward_args()):
        raise ValueError("a step's inputs do not have the shape of the bucket's buffers")
    for dst, src in zip(tensor_leaves(destination.forward_args()), tensor_leaves(source.forward_args()), strict=True):
        dst.copy_(src, non_blocking=True)


class StepMarks(Protocol):
    """The engine core's step timer, as a graph runner sees it: it marks where its h2d part ends."""

    def mark(self, part: str) -> None: ...


@dataclass(slots=True)
class StepBuffers:
    """A bucket's persistent inputs: the step's, and the per-token inputs a step module takes besides
    them (the MTP layer's previous hidden states), passed between positions and metadata."""

    inputs: ModelInputs
    row_inputs: tuple[torch.Tensor, ...] = ()  # [bucket tokens, width] each

    def forward_args(self) -> tuple[object, ...]:
        input_ids, positions, forward_metadata = self.inputs.forward_args()
        return (input_ids, positions, *self.row_inputs, forward_metadata)


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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> GraphOutput:
        hidden_states = self.model(input_ids, positions, forward_metadata)
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        return hidden_states, self.model.compute_logits(hidden_states, rows)


@dataclass(slots=True)
class BucketGraph:
    """One graph: its persistent input buffers and the callable that runs the step on them."""

    bucket: Bucket
    buffers: StepBuffers  # on the device, read by `run`; logits_indices is never read
    staging: ModelInputs | None  # pinned host mirror where the device is asynchronous
    run: GraphCallable
    warm_up_s: float
    origin: str  # how it was made, or which bucket's graph it is


class GraphRunner:
    """Owns the buckets' graphs and buffers; `forward` serves a decode or verify step or says it cannot.

    `step` is what a graph holds (DecodeStep of `model` unless given: the MTP's runners pass theirs),
    called with a step's input ids, positions, `row_inputs` (one [tokens, width] tensor each, of
    those widths and dtypes) and forward metadata."""

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
        step_timer: StepMarks | None = None,
        state_groups: tuple[int, ...] = (),
        agree_shape: AgreeShape | None = None,
        tokens_per_verify_row: int = 1,
        step: torch.nn.Module | None = None,
        row_inputs: tuple[tuple[int, torch.dtype], ...] = (),
        name: str = "",
    ) -> None:
        """`buckets`: the batch sizes; `tokens_per_verify_row` (1 + k with speculative decoding, else
        1): each batch size gets a verify bucket of that many tokens per request too. `state_groups`:
        the recurrent cache groups, whose padded rows read and write the null state slot. `name`: put
        before the buckets' names in the log and the compile cache (the MTP layer's runner).
        `agree_shape`: in lock-step, the MAX over the world of every rank's (rows, tokens per row),
        one collective every rank calls at every step; None where the ranks that share graphs run
        the same steps anyway."""
        self.step = step if step is not None else DecodeStep(model)
        self.step_timer = step_timer  # marks the end of h2d; None for a step module timed by its caller
        self.compiler = compiler
        self.batch_sizes = sorted(buckets)
        self.tokens_per_verify_row = tokens_per_verify_row
        self.buckets = [Bucket(n) for n in self.batch_sizes]
        if tokens_per_verify_row > 1:
            self.buckets += [Bucket(n, tokens_per_verify_row) for n in self.batch_sizes]
        self.device_builder = device_builder
        self.host_builder = host_builder
        self.num_cache_groups = num_cache_groups
        self.max_blocks_per_request = max_blocks_per_request
        self.state_groups = state_groups
        self.pin_host_buffers = pin_host_buffers
        self.agree_shape = agree_shape
        self.row_inputs = row_inputs
        self.name = name
        self.graphs: dict[Bucket, BucketGraph] = {}
        self.eager_reasons_logged: set[str] = set()
        self.steps_per_bucket: Counter[Bucket] = Counter()
        self.eager_steps = 0  # prefills and decode steps that fit no bucket
        self.warm_up_s = 0.0
        # The rows of the latest step's tokens in its graph (a verify bucket's: request i's from row
        # i x (1 + k)), where what the model kept per token inside it (EAGLE-3's hooked hidden states)
        # lies; None when they lead the rows (a decode bucket, a step run eagerly).
        self.token_rows: list[int] | None = None

    def graph_shape(self, bucket: Bucket) -> Bucket:
        """The graph a bucket runs: a verify bucket's padded step has the decode step's shapes at its
        token count (every token a decode row) unless a recurrent group reads it per request."""
        return bucket if self.state_groups else Bucket(bucket.num_tokens)

    def warm_up(self) -> float:
        """Compile or capture every bucket, largest first (so a shared memory pool is sized by the
        largest one); returns the total seconds."""
        total_start = time.perf_counter()
        made: dict[Bucket, BucketGraph] = {}
        order = sorted(self.buckets, key=lambda b: (b.num_tokens, -b.tokens_per_row), reverse=True)  # decode first
        for index, bucket in enumerate(order, start=1):
            shape = self.graph_shape(bucket)
            if shape in made:
                self.graphs[bucket] = graph = made[shape]
                logger.info(
                    "%s: bucket %s%s runs the graph of bucket %s%s (the same shapes)",
                    self.compiler.name,
                    self.name,
                    bucket.name,
                    self.name,
                    graph.bucket.name,
                )
                continue
            layout = padding_step(
                bucket.num_rows,
                self.num_cache_groups,
                self.max_blocks_per_request,
                self.state_groups,
                bucket.tokens_per_row,
            )
            buffers = StepBuffers(
                build_model_inputs(layout, self.device_builder),
                tuple(
                    torch.zeros(bucket.num_tokens, width, dtype=dtype, device=self.device_builder.device)
                    for width, dtype in self.row_inputs
                ),
            )
            start = time.perf_counter()
            doing = f"{self.compiler.name}: making bucket {self.name}{bucket.name} ({index} of {len(order)})"
            with announced_if_slow(logger, doing):
                run = self.compiler.compile(self.step, buffers, f"{self.name}{bucket.name}")
                run(buffers)  # the first call compiles where compiling is lazy
                self.compiler.synchronize()
            elapsed = time.perf_counter() - start
            staging = pinned_like(buffers.inputs) if self.pin_host_buffers else None
            self.graphs[bucket] = made[shape] = BucketGraph(bucket, buffers, staging, run, elapsed, run.origin)
            logger.info(
                "%s: bucket %s%s ready in %.1f s (%s)", self.compiler.name, self.name, bucket.name, elapsed, run.origin
            )
        self.warm_up_s = time.perf_counter() - total_start
        logger.info(
            "%s: %d buckets %s warmed up in %.1f s",
            self.compiler.name,
            len(self.buckets),
            [f"{self.name}{bucket.name}" for bucket in self.buckets],
            self.warm_up_s,
        )
        return self.warm_up_s

    def stats(self) -> dict[str, object]:
        """For the run summary: how each bucket was made, what ran as a graph and what did not."""

        def origin(bucket: Bucket, graph: BucketGraph) -> str:
            return graph.origin if graph.bucket == bucket else f"the graph of bucket {graph.bucket.name}"

        return {
            "compiler": self.compiler.name,
            "buckets": self.batch_sizes,
            "verify_buckets": [bucket.name for bucket in self.buckets if bucket.tokens_per_row > 1],
            "warm_up_s": self.warm_up_s,
            "bucket_origins": {bucket.name: origin(bucket, graph) for bucket, graph in sorted(self.graphs.items())},
            "graph_steps_per_bucket": {bucket.name: n for bucket, n in sorted(self.steps_per_bucket.items())},
            "eager_steps": self.eager_steps,
        }

    def forward(self, layout: StepLayout, *row_inputs: torch.Tensor) -> GraphOutput | None:
        """Hidden states [tokens, hidden] and logits [tokens, vocab] of a decode or verify step (a
        decode bucket's padding rows after the layout's), or None when the step must run eagerly.
        `row_inputs`: one tensor per `row_inputs` width, a row per token of the layout."""
        self.token_rows = None
        bucket = self._bucket_for(layout)
        if bucket is None:
            self.eager_steps += 1
            return None
        graph = self.graphs[bucket]
        fresh = build_model_inputs(pad_step(layout, bucket.num_rows, bucket.tokens_per_row), self.host_builder)
        if graph.staging is not None:
            copy_step(graph.staging, fresh)
            fresh = graph.staging
        copy_step(graph.buffers.inputs, fresh)
        # each request's tokens start at its row of 1 + k (consecutive rows in a decode step)
        rows = padded_token_rows(layout, bucket.tokens_per_row)
        for buffer, values in zip(graph.buffers.row_inputs, row_inputs, strict=True):
            put_rows(buffer, rows, values)
        if self.step_timer is not None:
            self.step_timer.mark("h2d")
        self.steps_per_bucket[bucket] += 1
        hidden_states, logits = graph.run(graph.buffers)
        if bucket.tokens_per_row == 1:
            return hidden_states, logits
        self.token_rows = rows
        return take_rows(hidden_states, rows), take_rows(logits, rows)

    def _bucket_for(self, layout: StepLayout) -> Bucket | None:
        longest = layout.max_query_len
        tokens_per_row = 1 if longest <= 1 else self.tokens_per_verify_row
        # a prefill runs eagerly, as in cann-recipes: nothing to log
        num_rows = layout.num_rows if longest <= tokens_per_row else NOT_DECODE
        if self.agree_shape is not None:  # a decode step joins a peer's verify bucket
            num_rows, tokens_per_row = self.agree_shape([num_rows, tokens_per_row])
        if num_rows == NOT_DECODE:
            return None
        batch_size = pick_bucket(num_rows, self.batch_sizes)
        if batch_size is None:
            kind = "decode" if tokens_per_row == 1 else "verify"
            self._log_eager_once(
                f"a {kind} step of {num_rows} rows fits no graph bucket (largest {self.batch_sizes[-1]}); "
                "steps this large run eagerly (scheduler_config.graph_buckets)"
            )
            return None
        return Bucket(batch_size, tokens_per_row)

    def _log_eager_once(self, reason: str) -> None:
        if reason not in self.eager_reasons_logged:
            self.eager_reasons_logged.add(reason)
            logger.warning(reason)
