"""Scheduler: the request lifecycle and prefill-first batching, with chunked prefill and preemption.

Waiting -> Prefilling -> Running -> Finished. Every step gives each scheduled request its
remaining tokens (num_tokens - num_computed_tokens), in a prefill step capped by the token budget
(max_prefill_tokens; under context parallel also at most cp_mini_batch requests): a prompt longer
than the budget is prefilled in chunks over several steps, a preempted request recomputes its
prompt and outputs, a decode step feeds one token. A step is a
prefill step (admitted requests still prefilling, then waiting requests, while slots and budget
last) or, when nothing needs prefilling, a decode step for every running request.

A waiting request is admitted when its tokens beyond its cached prefix fit the free blocks; its
computed tokens then start after the prefix. With num_lookahead_tokens (MTP), every request whose
step samples also gets that many slots past its fed tokens, for the proposer to write its drafts'
K/V into (a verify step's unaccepted slots are given back after it). When a running request cannot
get a block, the most recently admitted running request is preempted: its blocks are freed and it
goes back to the front of the waiting queue, to be recomputed later. A request that could not fit
the whole pool even alone fails at once, so a lone request always progresses.

The scheduler is the one writer of a Request: the KV cache manager reports a prefix hit without
applying it, and each step's runner returns a StepResult (new tokens, accepted drafts, logprobs,
prompt logprobs, next drafts) that the scheduler applies.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from executor.core.kv_cache import KVCacheManager
from executor.core.sampler.sampler import NAN_LOGITS_REASON, NAN_LOGITS_TOKEN
from executor.types_ import (
    Batch,
    FinishReason,
    Request,
    RequestStatus,
    StepResult,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerLimits:
    batch_size: int
    max_prefill_tokens: int
    max_model_len: int
    # most requests in one prefill step (scheduler_config.cp_mini_batch under context parallel); 0: no cap
    max_prefill_requests: int = 0


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: set[int],
        clock: Callable[[], float] = time.perf_counter,
        *,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """`num_lookahead_tokens`: the slots a proposer writes past a step's tokens (MTP: k - 1)."""
        self.limits = limits
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted requests (they hold blocks), oldest first
        self.num_preemptions = 0
        self.kv_blocks_peak = 0  # most blocks in use after any step
        self._newly_failed: list[Request] = []

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

    def take_failed(self) -> list[Request]:
        """The requests that failed alone since the last call (at add_request), to report once."""
        failed, self._newly_failed = self._newly_failed, []
        return failed

    def abort(self, request_id: str, now_s: float, error: str | None = None) -> Request | None:
        """Finish a waiting or admitted request at once, its blocks freed: finish reason ABORT, or
        ERROR with `error` as its reason; None when no such request is unfinished here. Between
        steps only (the engine core's rule)."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if queue is self.running:
                        self.kv_cache_manager.free(request)
                    return end_aborted(request, now_s, error)
        return None

    def schedule(self) -> Batch | None:
        """The next step's batch: prefill first, else one decode step of every running request;
        None when nothing can run. The batch carries each request's block ids, so the runner
        never reads the KV cache manager."""
        return self._schedule_prefill_batch() or self._schedule_decode_batch()

    # -- scheduling -------------------------------------------------------------------------

    def _schedule_prefill_batch(self) -> Batch | None:
        requests: list[Request] = []
        num_tokens: list[int] = []
        budget = self.limits.max_prefill_tokens
        max_requests = self.limits.max_prefill_requests or self.limits.batch_size
        for request in [r for r in self.running if r.status is RequestStatus.PREFILLING]:
            if budget == 0 or len(requests) == max_requests:
                break
            if request.status is RequestStatus.WAITING:  # preempted for an older request this step
                continue
            chunk = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, chunk, self._lookahead(request, chunk)):
                requests.append(request)
                num_tokens.append(chunk)
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.limits.batch_size:
            if len(requests) == max_requests:
                break
            request = self.waiting[0]
            hit = self.kv_cache_manager.find_prefix_hit(request)
            if not self.kv_cache_manager.can_admit(request, hit, self._lookahead(request, request.num_tokens)):
                break  # wait for running requests to finish and free their blocks
            self.kv_cache_manager.admit(request, hit)
            request.num_computed_tokens = hit.num_tokens
            chunk = min(request.num_tokens - request.num_computed_tokens, budget)
            allocated = self.kv_cache_manager.allocate_slots(request, chunk, self._lookahead(request, chunk))
            assert allocated is not None, "the request's tokens fit the free blocks, so its chunk does"
            self.waiting.popleft()
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            requests.append(request)
            num_tokens.append(chunk)
            budget -= chunk
        return self.kv_cache_manager.batch(requests, num_tokens, is_prefill=True) if requests else None

    def _schedule_decode_batch(self) -> Batch | None:
        """Every running request, each fed its tokens not yet computed (one after a normal step);
        max_prefill_tokens caps prefill steps only, so no running request sits out a decode step."""
        requests: list[Request] = []
        num_tokens: list[int] = []
        drafts: list[list[int]] = []
        for request in list(self.running):
            if request.status is RequestStatus.WAITING:  # preempted for an older request this step
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            request_drafts = self._drafts_to_verify(request)
            num_fed = num_new + len(request_drafts)
            if self._allocate_or_preempt(request, num_fed, self._lookahead(request, num_fed)):
                requests.append(request)
                num_tokens.append(num_fed)
                drafts.append(request_drafts)
        if not requests:
            return None
        return self.kv_cache_manager.batch(
            requests, num_tokens, is_prefill=False, draft_token_ids=drafts if any(drafts) else []
        )

    def _drafts_to_verify(self, request: Request) -> list[int]:
        """The request's proposed drafts, cut so that what a verify step can emit (accepted drafts
        and one more token) stays within max_new_tokens and every fed position within max_model_len."""
        room = min(
            request.sampling_params.max_new_tokens - len(request.output_token_ids) - 1,
            self.limits.max_model_len - request.num_tokens,
        )
        return request.spec_token_ids[: max(room, 0)]

    def _lookahead(self, request: Request, num_fed: int) -> int:
        """Slots past the `num_fed` tokens the request feeds next, for its proposer's drafts: none
        for a prompt chunk short of the prompt's end (it samples nothing), none past max_model_len."""
        end = request.num_computed_tokens + num_fed
        if not self.num_lookahead_tokens or end < request.num_tokens:
            return 0
        return max(min(self.num_lookahead_tokens, self.limits.max_model_len - end), 0)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """Blocks for the request's next tokens, preempting the newest running requests until they
        fit; False when the request itself had to be preempted."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and requeue it at the front; it recomputes its tokens later."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        logger.info(
            "preempted request %s (%d tokens computed): the KV cache is full; it will be recomputed",
            request.request_id,
            request.num_computed_tokens,
        )
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def cache_stats(self) -> dict[str, float | int]:
        """The KV cache figures of the run so far, for summary.json."""
        kv = self.kv_cache_manager
        return {
            "kv_blocks_peak": self.kv_blocks_peak,
            "kv_blocks_usable": kv.num_usable_blocks,
            "prefix_cache_hit_rate": kv.prefix_hit_rate,
            "prefix_cache_hit_tokens": kv.num_hit_tokens,
            "prefix_cache_queried_tokens": kv.num_queried_tokens,
            "evictions": kv.block_pool.num_evictions,
            "preemptions": self.num_preemptions,
        }

    def worst_case_blocks(self, request: Request) -> int:
        """Blocks the request holds at its longest (prompt + max_new_tokens and the lookahead slots,
        within max_model_len)."""
        longest = request.num_prompt_tokens + request.sampling_params.max_new_tokens + self.num_lookahead_tokens
        max_tokens = min(longest, self.limits.max_model_len)
        return self.kv_cache_manager.num_blocks_for_tokens(max_tokens)

    def _rejection_reason(self, request: Request) -> str | None:
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            return "empty prompt"
        if prompt_len >= self.limits.max_model_len:
            return (
                f"prompt has {prompt_len} tokens; the model's limit is {self.limits.max_model_len} tokens "
                "including at least one generated token (scheduler_config.max_model_len)"
            )
        worst_case = self.worst_case_blocks(request)
        if worst_case > self.kv_cache_manager.num_usable_blocks:
            return (
                f"request needs {worst_case} KV blocks but the pool has {self.kv_cache_manager.num_usable_blocks} "
                "(raise scheduler_config.num_blocks or mem_fraction_static)"
            )
        return None

    # -- state machine ----------------------------------------------------------------------

    def update_from_output(self, batch: Batch, result: StepResult) -> list[Request]:
        """Apply the step's result to its requests: computed tokens (a rejected draft's K/V is
        void), logprobs, prompt logprobs, next drafts, output tokens up to a stop; finish and free
        those that end."""
        now_s = self.clock()
        finished: list[Request] = []
        if result.prompt_logprobs is not None:
            self._append_prompt_logprobs(batch.requests, result.prompt_logprobs)
        next_drafts = result.next_drafts or [None] * len(batch.requests)
        for request, num_tokens, drafts, token_ids, num_accepted, logprobs, request_next_drafts in zip(
            batch.requests,
            batch.num_scheduled_tokens,
            batch.draft_token_ids or [[]] * len(batch.requests),
            result.new_token_ids,
            result.num_accepted_drafts,
            result.logprobs,
            next_drafts,
            strict=True,
        ):
            request.num_computed_tokens += num_tokens - (len(drafts) - num_accepted)
            request.output_logprobs.extend(logprobs)
            if request_next_drafts is not None:
                request.spec_token_ids = request_next_drafts
            if not token_ids:
                self.kv_cache_manager.cache_computed_blocks(request)
                continue  # a prompt chunk short of the prompt's end
            if request.status is RequestStatus.PREFILLING:
                request.status = RequestStatus.RUNNING
                if request.first_token_time_s is None:  # not again after a preemption
                    request.first_token_time_s = now_s
            reason = self._append_output_tokens(request, token_ids)
            self.kv_cache_manager.cache_computed_blocks(request)
            if drafts:
                self.kv_cache_manager.free_tail(request, request.num_tokens)  # the rejected drafts' slots
            if reason is not None:
                request.status = RequestStatus.FINISHED
                request.finish_reason = reason
                request.finish_time_s = now_s
                self._release(request)
                finished.append(request)
        return finished

    def _release(self, request: Request) -> None:
        """A request that just finished leaves the running ones and gives its blocks back (a
        prefill-role scheduler first hands its KV over: executor/online/disagg/)."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)

    @staticmethod
    def _append_prompt_logprobs(requests: list[Request], prompt_logprobs: list[list[TokenLogprobs]]) -> None:
        """Append the prompt tokens each request's step scored; the runner scores each position
        once (a recompute after a preemption scores none again), so entries stay one per token."""
        for request, entries in zip(requests, prompt_logprobs, strict=True):
            request.prompt_logprobs.extend(entries)
            assert len(request.prompt_logprobs) < request.num_prompt_tokens, "a prompt token was scored twice"

    def _append_output_tokens(self, request: Request, token_ids: list[int]) -> FinishReason | None:
        """Append tokens in order until one ends the request: EOS or a stop token (kept, and what
        follows it dropped), max_new_tokens, or the model's length limit; the sampler's mark of NaN
        logits ends it as failed."""
        params = request.sampling_params
        for token_id in token_ids:
            if token_id == NAN_LOGITS_TOKEN:  # the sampler's mark: the request fails alone
                request.error = NAN_LOGITS_REASON
                return FinishReason.ERROR
            request.output_token_ids.append(token_id)
            if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
                return FinishReason.STOP
            if (
                len(request.output_token_ids) >= params.max_new_tokens
                or request.num_tokens >= self.limits.max_model_len
            ):
                return FinishReason.LENGTH
        return None


def end_aborted(request: Request, now_s: float, error: str | None) -> Request:
    """An aborted request finished: failed with `error` when there is one, else with finish reason abort."""
    if error is not None:
        request.fail(error, now_s)
    else:
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
        request.finish_time_s = now_s
    return request
