"""Scheduler: the request lifecycle and prefill-first batching.

Waiting -> Prefilling -> Running -> Finished. Each step is either one prefill batch (as many
waiting requests as fit the running-slot, token and KV-block budgets) or, when nothing can be
prefilled, one decode step for every running request.

Until preemption exists, a request is admitted only when the pool can also hold its worst case
(prompt + max_new_tokens, capped at max_model_len) next to the worst cases still owed to the
requests already running, so a decode step never finds the pool empty.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from executor.core.kv_cache import KVCacheManager
from executor.core.types_ import Batch, FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


class BatchRunner(Protocol):
    def forward_batch(self, batch: Batch) -> list[int]: ...


@dataclass(slots=True)
class SchedulerLimits:
    batch_size: int
    max_prefill_tokens: int
    max_model_len: int


@dataclass(slots=True)
class StepRecord:
    step: int
    phase: str  # "prefill" | "decode"
    batch_size: int
    num_tokens: int
    step_time_ms: float
    kv_usage: float

    def log_line(self) -> str:
        return (
            f"step {self.step:5d} | {self.phase:7s} | batch {self.batch_size:3d} | tokens {self.num_tokens:5d} "
            f"| {self.step_time_ms:8.2f} ms | kv {self.kv_usage:5.1%}"
        )


@dataclass(slots=True)
class StepOutput:
    record: StepRecord | None  # None when the step only retired requests that failed alone
    finished: list[Request]


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: set[int],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.limits = limits
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._newly_failed: list[Request] = []
        self._step = 0

    def add_request(self, request: Request) -> None:
        """Queue a request, or fail it alone at once when it can never be served."""
        request.arrival_time_s = self.clock()
        reason = self._rejection_reason(request)
        if reason is not None:
            request.fail(reason, self.clock())
            self._newly_failed.append(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._newly_failed)

    def run_step(self, engine: BatchRunner) -> StepOutput:
        """Schedule one batch, run it, and advance the requests' states."""
        finished, self._newly_failed = self._newly_failed, []
        batch = self._schedule_batch()
        if batch is None:
            if finished:
                return StepOutput(record=None, finished=finished)
            raise RuntimeError("scheduler stalled: requests wait but none can be scheduled")
        start_s = self.clock()
        next_token_ids = engine.forward_batch(batch)
        step_time_ms = (self.clock() - start_s) * 1e3
        batch.update_requests_from_batch(next_token_ids)
        self._step += 1
        record = StepRecord(
            step=self._step,
            phase="prefill" if batch.is_prefill else "decode",
            batch_size=batch.size,
            num_tokens=batch.total_tokens,
            step_time_ms=step_time_ms,
            kv_usage=self.kv_cache_manager.usage,
        )
        finished.extend(self._process_batch_output(batch))
        logger.info(record.log_line())
        return StepOutput(record=record, finished=finished)

    # -- scheduling -------------------------------------------------------------------------

    def _schedule_batch(self) -> Batch | None:
        return self._schedule_prefill_batch() or self._schedule_decode_batch()

    def _schedule_prefill_batch(self) -> Batch | None:
        requests: list[Request] = []
        num_tokens: list[int] = []
        reserved_blocks = sum(self._blocks_still_owed(r) for r in self.running)
        while self.waiting and len(self.running) + len(requests) < self.limits.batch_size:
            request = self.waiting[0]
            if sum(num_tokens) + request.num_prompt_tokens > self.limits.max_prefill_tokens:
                break
            worst_case = self.kv_cache_manager.num_blocks_for_tokens(self._max_total_tokens(request))
            if self.kv_cache_manager.num_free_blocks - reserved_blocks < worst_case:
                break  # wait for running requests to finish and free their blocks
            if self.kv_cache_manager.allocate_slots(request, request.num_prompt_tokens) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.PREFILLING
            reserved_blocks += self._blocks_still_owed(request)
            requests.append(request)
            num_tokens.append(request.num_prompt_tokens)
        return Batch(requests, is_prefill=True, num_scheduled_tokens=num_tokens) if requests else None

    def _schedule_decode_batch(self) -> Batch | None:
        requests = [r for r in self.running if self.kv_cache_manager.allocate_slots(r, 1) is not None]
        return Batch(requests, is_prefill=False, num_scheduled_tokens=[1] * len(requests)) if requests else None

    def _max_total_tokens(self, request: Request) -> int:
        """The most tokens the request can ever hold in the cache."""
        return min(request.num_prompt_tokens + request.sampling_params.max_new_tokens, self.limits.max_model_len)

    def _blocks_still_owed(self, request: Request) -> int:
        worst_case = self.kv_cache_manager.num_blocks_for_tokens(self._max_total_tokens(request))
        return max(0, worst_case - self.kv_cache_manager.num_blocks_held(request.request_id))

    def _rejection_reason(self, request: Request) -> str | None:
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            return "empty prompt"
        if prompt_len >= self.limits.max_model_len:
            return (
                f"prompt has {prompt_len} tokens; the model's limit is {self.limits.max_model_len} tokens "
                "including at least one generated token (scheduler_config.max_model_len)"
            )
        if prompt_len > self.limits.max_prefill_tokens:
            return (
                f"prompt has {prompt_len} tokens, more than scheduler_config.max_prefill_tokens "
                f"({self.limits.max_prefill_tokens})"
            )
        worst_case = self.kv_cache_manager.num_blocks_for_tokens(self._max_total_tokens(request))
        if worst_case > self.kv_cache_manager.num_blocks:
            return (
                f"request needs {worst_case} KV blocks but the pool has {self.kv_cache_manager.num_blocks} "
                "(raise scheduler_config.num_blocks or mem_fraction_static)"
            )
        return None

    # -- state machine ----------------------------------------------------------------------

    def _process_batch_output(self, batch: Batch) -> list[Request]:
        now_s = self.clock()
        finished: list[Request] = []
        for request in batch.requests:
            if request.status is RequestStatus.PREFILLING:
                request.status = RequestStatus.RUNNING
                request.first_token_time_s = now_s
                self.running.append(request)
            reason = self._finish_reason(request)
            if reason is not None:
                request.status = RequestStatus.FINISHED
                request.finish_reason = reason
                request.finish_time_s = now_s
                self.running.remove(request)
                self.kv_cache_manager.free(request)
                finished.append(request)
        return finished

    def _finish_reason(self, request: Request) -> FinishReason | None:
        last_token = request.output_token_ids[-1]
        params = request.sampling_params
        if last_token in params.stop_token_ids or (not params.ignore_eos and last_token in self.eos_token_ids):
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_new_tokens or request.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None
