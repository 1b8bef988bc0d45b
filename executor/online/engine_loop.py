"""EngineLoop: the engine core stepped on a thread of its own, fed by the HTTP side between steps.

The server's handlers tokenize a request and `submit` it with a sink; the loop adds it to the core
before its next step (so a request that arrives while others decode joins at the next step), steps
while anything runs, and hands each request's new tokens to its sink as an `Update`. `abort`
(a client gone, a stop string met) ends a request before the next step and frees its blocks.

Under torchrun rank 0 takes the HTTP requests and every rank runs this loop: each turn rank 0
broadcasts what arrived (requests with the replica each goes to, aborts, whether to stop) over the
world's gloo group, every replica adds its own and steps (in lock-step, a replica with nothing to
run joins with an idle forward), and the replicas' updates are gathered back on rank 0, as
cann-recipes' dispatcher does. With nothing to run, rank 0 still sends a turn every
`HEARTBEAT_S`, so the others never sit in a collective past its timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from executor.core.engine import EngineStep, ExecutionEngine, RequestOutput
from executor.types_ import FinishReason, Request, TokenLogprobs

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # most seconds between two turns of the ranks' loop while nothing runs


@dataclass(slots=True)
class Update:
    """What one step did for one request, as its sink receives it (plain data: it crosses ranks)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error", once it ends
    error: str | None = None
    # the prompt tokens' logprobs (SamplingParams.prompt_logprobs), sent once, with the first tokens
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class EngineStats:
    """The figures /metrics and /stats read, as of the last step (summed over the replicas)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_usable: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class _Turn:
    """What rank 0 sends every rank before a step."""

    requests: list[tuple[Request, int]] = field(default_factory=list)  # with the replica each joins
    aborts: list[str] = field(default_factory=list)
    stop: bool = False


class QueueFull(Exception):
    """More requests in flight than the server admits (the caller answers 503)."""


class EngineLoop:
    def __init__(self, engine: ExecutionEngine, max_waiting_requests: int) -> None:
        """`max_waiting_requests`: requests that may wait beyond the ones the replicas run at once."""
        self.engine = engine
        self.core = engine.core
        self.comm = engine.comm
        self.num_replicas = self.comm.layout.attn_dp_size
        self.max_in_flight = engine.config.scheduler_config.batch_size * self.num_replicas + max_waiting_requests
        # this replica's figures, and what /metrics reads: the same in one process, their sum over the
        # replicas on rank 0 under torchrun (kept apart, or rank 0 would send the last sum as its own)
        self.replica_stats = EngineStats(kv_blocks_usable=self.core.scheduler.kv_cache_manager.num_usable_blocks)
        self.stats = self.replica_stats
        self.on_step: Callable[[EngineStep], None] | None = None  # rank 0's step hook (metrics)
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._sinks: dict[str, Callable[[Update], None]] = {}
        self._replica_of: dict[str, int] = {}
        self._inbox = _Turn()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- the HTTP side (rank 0) -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def submit(self, request: Request, sink: Callable[[Update], None]) -> None:
        """Queue `request` for the next step; `sink` gets its updates on the loop's thread.
        QueueFull when the server already holds as many requests as it admits."""
        with self._wake:
            if self._inbox.stop or self.error is not None:
                raise QueueFull("the server is stopping")
            if len(self._sinks) >= self.max_in_flight:
                raise QueueFull(f"{len(self._sinks)} requests in flight, the most this server admits")
            if request.request_id in self._sinks:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._sinks[request.request_id] = sink
            self._inbox.requests.append((request, self._pick_replica()))
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        """End the request before the next step (no-op once it has ended)."""
        with self._wake:
            if request_id in self._sinks:
                self._inbox.aborts.append(request_id)
                self._wake.notify()

    def stop(self, timeout_s: float | None = None) -> None:
        """Abort what still runs, end the loop on every rank, and wait for it."""
        with self._wake:
            self._inbox.aborts.extend(self._sinks)
            self._inbox.stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _pick_replica(self) -> int:
        """The data-parallel replica with the fewest requests in flight (the first of equals)."""
        if self.num_replicas == 1:
            return 0
        counts = [0] * self.num_replicas
        for replica in self._replica_of.values():
            counts[replica] += 1
        for _, replica in self._inbox.requests:
            counts[replica] += 1
        return counts.index(min(counts))

    # -- the loop (every rank) ----------------------------------------------------------------

    def run(self) -> None:
        """Turns until rank 0 says stop: take what arrived, step, hand out the updates."""
        try:
            while True:
                turn = self._next_turn()
                self._apply(turn)
                updates = self._step()
                if self.comm.is_distributed:
                    updates = self._gather(updates)
                if self.comm.rank == 0:
                    self._publish(updates)
                if turn.stop:
                    return
        except BaseException as exc:  # the HTTP side answers 503 from now on and the server stops
            logger.exception("the engine loop stopped")
            self.error = exc
            if self.comm.rank == 0:
                self._fail_in_flight(f"the engine stopped: {exc}")

    def _next_turn(self) -> _Turn:
        """Rank 0: what arrived since the last turn (waiting for something while nothing runs);
        the other ranks: what rank 0 sent."""
        turn = None
        if self.comm.rank == 0:
            with self._wake:
                if not (self._inbox.requests or self._inbox.aborts or self._inbox.stop or self.core.has_work()):
                    self._wake.wait(self._idle_wait_s())
                turn, self._inbox = self._inbox, _Turn()
                for request, replica in turn.requests:
                    self._replica_of[request.request_id] = replica
        if self.comm.is_distributed:
            turn = self.comm.broadcast_from_rank0(turn)
        assert turn is not None
        return turn

    def _idle_wait_s(self) -> float | None:
        """Longest rank 0 waits for something to arrive while nothing runs (None: until woken)."""
        return HEARTBEAT_S if self.comm.is_distributed else None

    def wake(self) -> None:
        """Cut the idle wait short (something outside the HTTP side has work for the loop)."""
        with self._wake:
            self._wake.notify()

    def _apply(self, turn: _Turn) -> None:
        for request, replica in turn.requests:
            if replica == self.comm.dp_rank:
                self.core.add_request(request)
        for request_id in turn.aborts:
            self.core.abort_request(request_id)

    def _step(self) -> list[Update]:
        has_work = self.core.has_work()
        if self.engine.lock_step:  # every replica runs a forward while any has work
            anyone_has_work, _ = self.comm.agree_over_world(has_work, False)
            if anyone_has_work and not has_work:
                self.engine.runner.idle_forward()
                return []
        if not has_work:
            return []
        try:
            step = self.core.step()
        except Exception as exc:
            if self.comm.is_distributed:  # the ranks' collectives no longer match: the server stops
                raise
            logger.exception("a step failed; its requests fail, the server goes on")
            self.core.fail_running(f"the step running this request failed: {type(exc).__name__}: {exc}")
            return []  # the next turn's step reports them
        self._update_stats(step)
        if self.on_step is not None and self.comm.rank == 0:
            self.on_step(step)
        return [update_of(output) for output in step.outputs] if self.comm.is_dp_leader else []

    def _update_stats(self, step: EngineStep) -> None:
        scheduler = self.core.scheduler
        kv = scheduler.kv_cache_manager
        stats = self.replica_stats
        stats.num_running, stats.num_waiting = len(scheduler.running), len(scheduler.waiting)
        stats.kv_blocks_used = kv.block_pool.num_used_blocks
        stats.prefix_hit_tokens, stats.prefix_queried_tokens = kv.num_hit_tokens, kv.num_queried_tokens
        stats.num_steps += step.record is not None
        stats.num_preemptions = scheduler.num_preemptions

    def _gather(self, updates: list[Update]) -> list[Update]:
        """Every replica's updates (and stats) on rank 0; an empty list elsewhere."""
        gathered = self.comm.gather_to_rank0((updates, self.replica_stats if self.comm.is_dp_leader else None))
        if gathered is None:
            return []
        replica_stats = [stats for _, stats in gathered if stats is not None]
        self.stats = EngineStats(
            **{name: sum(getattr(stats, name) for stats in replica_stats) for name in EngineStats.__slots__}
        )
        return [update for replica_updates, _ in gathered for update in replica_updates]

    def _publish(self, updates: list[Update]) -> None:
        for update in updates:
            with self._wake:
                sink = self._sinks.get(update.request_id)
                if update.finish_reason is not None:
                    self._sinks.pop(update.request_id, None)
                    self._replica_of.pop(update.request_id, None)
            if sink is not None:
                sink(update)

    def _fail_in_flight(self, reason: str) -> None:
        with self._wake:
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(Update(request_id, [], [], finish_reason=FinishReason.ERROR.value, error=reason))


def update_of(output: RequestOutput) -> Update:
    """The sink's update for what one step (or a KV arrival) did for a request."""
    request = output.request
    update = Update(request.request_id, list(output.new_token_ids), list(output.new_logprobs))
    first = bool(output.new_token_ids) and len(request.output_token_ids) == len(output.new_token_ids)
    if request.sampling_params.prompt_logprobs is not None and first:  # prefill done: every prompt token scored
        update.prompt_logprobs = list(request.prompt_logprobs)
    if output.finished:
        assert output.finish_reason is not None
        update.finish_reason = output.finish_reason.value
        update.error = request.error
    return update
