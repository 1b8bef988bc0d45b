"""EngineCore (vLLM's name): the one loop both entries drive, offline and online.

A step is three calls in order: the scheduler schedules a batch (block ids included), the runner
executes it, the scheduler applies the result. Requests may be added or aborted between any two
steps; each step hands back, per request that moved, its new tokens, their logprobs and, once it
ends, its finish reason. The step's time is measured here and nowhere else: the core starts and
stops the StepTimer, the runner (and a graph runner, for h2d) only marks where each part ends. On
CPU a mark is a clock read; on an asynchronous device (CUDA, NPU) a mark first waits for the
device, so that each part owns the device work it queued. That wait costs host/device overlap, so
there it is only done when asked for (model_config.step_breakdown; docs/profiling.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from executor.core.scheduler import Scheduler
from executor.types_ import AcceptCounts, Batch, FinishReason, Request, StepResult, StepRunner, TokenLogprobs

# The parts of a step, in the order they run; `propose` only in speculative decoding.
PARTS = ("prepare", "h2d", "forward", "sample", "propose", "output")


class StepTimer:
    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        *,
        breakdown: bool = False,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self.clock = clock
        self.breakdown = breakdown
        self.synchronize = synchronize  # None where the device runs in step with the host
        self._active = False
        self._start_s = 0.0
        self._last_s = 0.0
        self._parts_ms: dict[str, float] = {}

    def start(self) -> None:
        self._active = True
        self._start_s = self._last_s = self.clock()
        self._parts_ms = {}

    def mark(self, part: str) -> None:
        """Close `part`: the time since the previous mark (or the start) is its. A no-op outside a
        step (warm-up, a draft engine's own steps) and without the breakdown."""
        if not (self._active and self.breakdown):
            return
        assert part in PARTS, part
        if self.synchronize is not None:
            self.synchronize()
        now_s = self.clock()
        self._parts_ms[part] = self._parts_ms.get(part, 0.0) + (now_s - self._last_s) * 1e3
        self._last_s = now_s

    def stop(self, last_part: str) -> tuple[float, dict[str, float] | None]:
        """End the step with `last_part`; its time (ms) and, with the breakdown, its parts (ms),
        which sum to that time."""
        self.mark(last_part)
        self._active = False
        end_s = self._last_s if self.breakdown else self.clock()
        return (end_s - self._start_s) * 1e3, (dict(self._parts_ms) if self.breakdown else None)


class PhaseProfiler(Protocol):
    def profile(self, phase: str) -> AbstractContextManager[bool]:
        """Wraps one step of `phase` ("prefill" | "decode"); yields whether it is being profiled."""
        ...


@dataclass(slots=True)
class StepRecord:
    step: int
    phase: str  # "prefill" | "decode"
    batch_size: int
    num_tokens: int
    step_time_ms: float
    kv_usage: float
    kv_blocks_used: int
    prefix_hit_rate: float  # of the run so far: cached tokens reused / tokens looked up at admission
    evictions: int  # of the run so far
    preemptions: int  # of the run so far
    # speculative decoding, this step's AcceptCounts: drafts verified, accepted, the requests that
    # verified, and the first two per draft position (the totals are their sums)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_requests: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # of them, the verifies of drafts that prompt lookup gave (speculative_config.prompt_lookup)
    looked_up_verified_requests: int = 0
    looked_up_draft_tokens: int = 0
    looked_up_accepted_tokens: int = 0
    parts_ms: dict[str, float] | None = None  # step_time_ms split into step_timer.PARTS; None: breakdown off
    profiled: bool = False  # ran under the profiler, so its times are not the run's
    # bytes this rank handed to each collective this step ("<group>.<op>"); empty in one process
    comm_bytes: dict[str, int] = field(default_factory=dict)

    def log_line(self) -> str:
        line = (
            f"step {self.step:5d} | {self.phase:7s} | batch {self.batch_size:3d} | tokens {self.num_tokens:5d} "
            f"| {self.step_time_ms:8.2f} ms | kv {self.kv_usage:5.1%} ({self.kv_blocks_used} blocks) "
            f"| prefix hits {self.prefix_hit_rate:5.1%} | evicted {self.evictions} | preempted {self.preemptions}"
        )
        if self.num_draft_tokens:
            by_position = zip(self.accepted_per_position, self.drafted_per_position, strict=True)
            line += (
                f" | accepted {self.num_accepted_tokens}/{self.num_draft_tokens} drafts "
                f"(by position {' '.join(f'{a}/{d}' for a, d in by_position)}), accept length "
                f"{1 + self.num_accepted_tokens / self.num_verified_requests:.2f}"
            )
            if self.looked_up_verified_requests:
                line += f" ({self.looked_up_verified_requests} looked up)"
        if self.parts_ms:
            line += " | " + " ".join(f"{part} {ms:.2f}" for part, ms in self.parts_ms.items()) + " ms"
        return line

    def cann_log_line(self) -> str:
        """The step's time as cann-recipes prints it, for the scripts its users grep logs with."""
        return f"[Main] Inference time ({self.phase}): {self.step_time_ms:.2f} ms"


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request: the tokens it appended (their logprobs where asked for),
    and, when it ended, why. `request` is the request itself, for whoever needs the whole of it."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.request.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.request.finish_reason


@dataclass(slots=True)
class EngineStep:
    record: StepRecord | None  # None when no forward ran (only failures or aborts to report)
    outputs: list[RequestOutput]  # each request that gained tokens or ended, in batch order

    @property
    def finished(self) -> list[Request]:
        return [output.request for output in self.outputs if output.finished]


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        timer: StepTimer | None = None,
    ) -> None:
        """`timer`: the one the runner marks parts on (a plain timer on the scheduler's clock when not given)."""
        self.scheduler = scheduler
        self.runner = runner
        self.clock = scheduler.clock
        self.timer = timer if timer is not None else StepTimer(self.clock)
        self._aborted: list[Request] = []
        self._num_steps = 0

    def add_request(self, request: Request) -> None:
        """Queue a request for the next step (one that can never be served fails alone at once)."""
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        """End an unfinished request now (finish reason abort), its KV blocks freed; the next step
        reports it. False when no unfinished request has this id."""
        request = self.scheduler.abort(request_id, self.clock())
        if request is not None:
            self._aborted.append(request)
        return request is not None

    def fail_running(self, error: str) -> list[str]:
        """Fail every admitted request with `error` (their blocks freed), as after a step that
        raised: their cached state may be half-written. The waiting ones are untouched; the next
        step reports the failed ones. Their ids."""
        ids = [request.request_id for request in self.scheduler.running]
        for request_id in ids:
            self._aborted.append(self.scheduler.abort(request_id, self.clock(), error))
        return ids

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    def step(self, profiler: PhaseProfiler | None = None) -> EngineStep:
        """Schedule one batch, run it (under `profiler` if given) and apply its result; the failed
        and aborted requests since the last step are reported first."""
        ended = self.scheduler.take_failed() + self._aborted
        self._aborted = []
        outputs = [RequestOutput(request, [], []) for request in ended]
        self.timer.start()
        batch = self.scheduler.schedule()
        if batch is None:
            if outputs:
                return EngineStep(record=None, outputs=outputs)
            raise RuntimeError("scheduler stalled: requests wait but none can be scheduled")
        phase = "prefill" if batch.is_prefill else "decode"
        num_outputs_before = [len(request.output_token_ids) for request in batch.requests]
        num_logprobs_before = [len(request.output_logprobs) for request in batch.requests]
        with profiler.profile(phase) if profiler is not None else nullcontext(False) as profiled:
            result = self.runner.execute(batch)
        self.scheduler.update_from_output(batch, result)
        step_time_ms, parts_ms = self.timer.stop("output")
        for request, num_tokens, num_logprobs in zip(
            batch.requests, num_outputs_before, num_logprobs_before, strict=True
        ):
            if len(request.output_token_ids) > num_tokens or request.is_finished:
                outputs.append(
                    RequestOutput(
                        request, request.output_token_ids[num_tokens:], request.output_logprobs[num_logprobs:]
                    )
                )
        self._num_steps += 1
        kv = self.scheduler.kv_cache_manager
        record = StepRecord(
            step=self._num_steps,
            phase=phase,
            batch_size=len(batch.requests),
            num_tokens=sum(batch.num_scheduled_tokens),
            step_time_ms=step_time_ms,
            kv_usage=kv.usage,
            kv_blocks_used=kv.block_pool.num_used_blocks,
            prefix_hit_rate=kv.prefix_hit_rate,
            evictions=kv.block_pool.num_evictions,
            preemptions=self.scheduler.num_preemptions,
            **_speculation_counts(batch, result),
            parts_ms=parts_ms,
            profiled=profiled,
        )
        self.scheduler.kv_blocks_peak = max(self.scheduler.kv_blocks_peak, record.kv_blocks_used)
        return EngineStep(record=record, outputs=outputs)


def _speculation_counts(batch: Batch, result: StepResult) -> dict[str, Any]:
    """StepRecord's speculation fields: the step's AcceptCounts (drafts verified and accepted, per
    position and in all, and by how many requests), and those of the drafts prompt lookup gave."""
    if not batch.draft_token_ids:
        return {}
    counts = AcceptCounts()
    for drafts, accepted in zip(batch.draft_token_ids, result.num_accepted_drafts, strict=False):
        if drafts:
            counts.add_verify(len(drafts), accepted)
    looked_up = result.looked_up or AcceptCounts()
    return {
        "num_draft_tokens": counts.num_drafted,
        "num_accepted_tokens": counts.num_accepted,
        "num_verified_requests": counts.verifies,
        "drafted_per_position": counts.drafted,
        "accepted_per_position": counts.accepted,
        "looked_up_verified_requests": looked_up.verifies,
        "looked_up_draft_tokens": looked_up.num_drafted,
        "looked_up_accepted_tokens": looked_up.num_accepted,
    }
