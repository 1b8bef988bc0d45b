"""The role schedulers (cann-recipes' PrefillDisaggScheduler and DecodeDisaggScheduler): the base
Scheduler, with what each role does besides.

Prefill: requests arrive with max_new_tokens 1; when one finishes (its prompt prefilled, its first
token sampled), `on_prefilled` gets it and its blocks before they are freed, to gather its KV for
the transfer; a request that fails or is aborted here is told to the transfer (`on_failed`), so
that its decode side fails at once rather than at the timeout.

Decode: a request with a ticket does not prefill. It waits in `pending` until the pool holds its
prompt and `num_reserved_decode_tokens` more (admission with room to decode), then gets blocks for
its prompt and waits in `transferring` while its KV comes (`on_admitted` asks for it); `kv_arrived`
makes it a running request with its first token, `fail_transfer` fails it alone, and either way
its blocks are freed if it ends. Under memory pressure the cheapest running request (fewest
computed tokens) not yet scheduled this step is retracted: its blocks are freed, it goes back to
the front of the waiting queue with its tokens, and is recomputed here (a local prefill of its
prompt and outputs) before new transfers are admitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from executor.core.kv_cache.kv_cache_manager import PrefixHit
from executor.core.scheduler import Scheduler
from executor.core.scheduler.scheduler import end_aborted
from executor.types_ import FinishReason, Request, RequestStatus, TokenLogprobs


@dataclass(frozen=True, slots=True)
class DisaggTicket:
    """What pairs a request's two halves: the Router's room (per choice) and the prefill
    instance's bootstrap server."""

    room: str
    bootstrap_host: str
    bootstrap_port: int


class PrefillDisaggScheduler(Scheduler):
    on_prefilled: Callable[[Request, DisaggTicket, list[list[int]]], None]
    on_failed: Callable[[DisaggTicket, str], None]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tickets: dict[str, DisaggTicket] = {}
        self.on_prefilled = lambda request, ticket, rows: None
        self.on_failed = lambda ticket, why: None

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if request.is_finished:  # rejected: it can never be prefilled
            self._tell_failed(request, request.error or "rejected")

    def abort(self, request_id: str, now_s: float, error: str | None = None) -> Request | None:
        request = super().abort(request_id, now_s, error)
        if request is not None:
            self._tell_failed(request, error or "aborted on the prefill instance")
        return request

    def _release(self, request: Request) -> None:
        ticket = self.tickets.pop(request.request_id, None)
        if ticket is not None:
            if request.finish_reason is FinishReason.ERROR:
                self.on_failed(ticket, request.error or "failed")
            else:
                self.on_prefilled(request, ticket, self.kv_cache_manager.get_block_ids(request.request_id))
        super()._release(request)

    def _tell_failed(self, request: Request, why: str) -> None:
        ticket = self.tickets.pop(request.request_id, None)
        if ticket is not None:
            self.on_failed(ticket, why)


class DecodeDisaggScheduler(Scheduler):
    on_admitted: Callable[[Request, DisaggTicket, list[list[int]]], None]
    on_dropped: Callable[[DisaggTicket, bool], None]  # (ticket, whether it timed out)

    def __init__(self, *args: object, num_reserved_decode_tokens: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.num_reserved_decode_tokens = num_reserved_decode_tokens
        self.tickets: dict[str, DisaggTicket] = {}
        self.pending: deque[Request] = deque()  # waiting for blocks to receive their KV into
        self.transferring: dict[str, tuple[Request, float]] = {}  # request id -> (request, since)
        self.num_retractions = 0
        self.on_admitted = lambda request, ticket, rows: None
        self.on_dropped = lambda ticket, timed_out: None

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.tickets:
            super().add_request(request)  # no ticket: served whole here (the recompute path)
            return
        request.arrival_time_s = self.clock()
        reason = self._rejection_reason(request)
        if reason is not None:
            request.fail(reason, self.clock())
            self._newly_failed.append(request)
            self.on_dropped(self.tickets.pop(request.request_id), False)
            return
        request.status = RequestStatus.WAITING
        self.pending.append(request)

    @property
    def num_in_transfer(self) -> int:
        return len(self.pending) + len(self.transferring)

    def admit_pending(self) -> None:
        """Give blocks to the pending requests that fit, oldest first, after the retracted ones
        (`waiting`) and within batch_size; each then asks for its KV. cann-recipes' admission: every
        request in flight (transferring or running) keeps `num_reserved_decode_tokens` of room past
        its tokens, and a new one is admitted only if its prompt and its own reservation fit the
        free blocks less the others' reservations."""
        no_hit = PrefixHit([[] for _ in range(self.kv_cache_manager.num_groups)], 0)
        while self.pending and not self.waiting:
            if len(self.running) + len(self.transferring) >= self.limits.batch_size:
                return
            request = self.pending[0]
            needed = self.kv_cache_manager.num_blocks_for_tokens(self._reserved_length(request))
            if not self.kv_cache_manager.can_admit(request, no_hit) or needed > self._free_beyond_reservations():
                return
            allocated = self.kv_cache_manager.allocate_slots(request, request.num_prompt_tokens)
            assert allocated is not None, "its tokens and more fit the free blocks, so its prompt does"
            self.pending.popleft()
            self.transferring[request.request_id] = (request, self.clock())
            rows = self.kv_cache_manager.get_block_ids(request.request_id)
            self.on_admitted(request, self.tickets[request.request_id], rows)

    def _reserved_length(self, request: Request) -> int:
        """The request's tokens and the reserved decode tokens, within max_model_len."""
        return min(request.num_tokens + self.num_reserved_decode_tokens, self.limits.max_model_len)

    def _free_beyond_reservations(self) -> int:
        """Free blocks less what the requests in flight still reserve beyond the blocks they hold."""
        kv = self.kv_cache_manager
        in_flight = self.running + [request for request, _ in self.transferring.values()]
        reserved = 0
        for request in in_flight:
            rows = kv.get_block_ids(request.request_id)
            held = sum(len(row) for group, row in enumerate(rows) if group not in kv.state_groups)
            reserved += max(kv.num_blocks_for_tokens(self._reserved_length(request)) - held, 0)
        return kv.num_free_blocks - reserved

    def kv_arrived(
        self,
        request_id: str,
        first_token_ids: list[int],
        logprobs: list[TokenLogprobs],
        prompt_logprobs: list[TokenLogprobs],
    ) -> Request:
        """The request's KV is in its blocks (the caller wrote it): it runs from its first token,
        or ends with it (a stop token, max_new_tokens 1)."""
        request, _ = self.transferring.pop(request_id)
        self.tickets.pop(request_id)
        now_s = self.clock()
        request.num_computed_tokens = request.num_prompt_tokens
        request.prompt_logprobs.extend(prompt_logprobs)
        request.output_logprobs.extend(logprobs)
        request.first_token_time_s = now_s
        reason = self._append_output_tokens(request, first_token_ids)
        self.kv_cache_manager.cache_computed_blocks(request)
        if reason is None:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            return request
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time_s = now_s
        self.kv_cache_manager.free(request)
        return request

    def fail_transfer(self, request_id: str, why: str, timed_out: bool = False) -> Request | None:
        """End a pending or transferring request as failed, its blocks freed; the next step reports it."""
        request = self._take_unstarted(request_id, timed_out)
        if request is None:
            return None
        request.fail(why, self.clock())
        self._newly_failed.append(request)
        return request

    def expired(self, timeout_s: float) -> list[str]:
        """The transferring requests that have waited for their KV longer than `timeout_s`."""
        now_s = self.clock()
        return [rid for rid, (_, since) in self.transferring.items() if now_s - since > timeout_s]

    def ticket_of(self, request_id: str) -> DisaggTicket | None:
        return self.tickets.get(request_id)

    def abort(self, request_id: str, now_s: float, error: str | None = None) -> Request | None:
        request = self._take_unstarted(request_id)
        if request is None:
            return super().abort(request_id, now_s, error)
        return end_aborted(request, now_s, error)

    def has_failed(self) -> bool:
        """Failed requests wait to be reported by the next step."""
        return bool(self._newly_failed)

    def _take_unstarted(self, request_id: str, timed_out: bool = False) -> Request | None:
        """Remove a pending or transferring request (its blocks freed, the prefill side told)."""
        entry = self.transferring.pop(request_id, None)
        request = entry[0] if entry is not None else next((r for r in self.pending if r.request_id == request_id), None)
        if request is None:
            return None
        if entry is not None:
            self.kv_cache_manager.free(request)
        else:
            self.pending.remove(request)
        ticket = self.tickets.pop(request_id, None)
        if ticket is not None:
            self.on_dropped(ticket, timed_out)
        return request

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """As the base scheduler's, but the victim is the cheapest to recompute (fewest computed
        tokens; the newest of equals) among the request and those after it, which this step has
        not scheduled yet (it schedules running requests oldest first)."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens) is None:
            candidates = self.running[self.running.index(request) :]
            victim = min(reversed(candidates), key=lambda r: r.num_computed_tokens)
            self._preempt(victim)
            self.num_retractions += 1
            if victim is request:
                return False
        return True
