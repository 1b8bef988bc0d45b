"""DisaggEngineLoop: the online engine loop of a prefill or a decode instance.

It is the combined server's EngineLoop with the role's scheduler in the engine core and the role's
half of the KV transfer beside it. Requests come with a ticket (the Router's room and the prefill
instance's bootstrap server); the loop hands it to the scheduler on the engine's thread. A prefill
instance's leader also runs the Bootstrap server and the TCPStore its pair groups meet on; under
torchrun (attention tensor parallel) every rank prefills every request, gathers its share of the
request's KV heads and sends it from a transfer socket of its own, registered there.

On a decode instance, before every step the loop takes what arrived (writes each request's KV
into its blocks, makes it a running request and sends its first token), fails the requests whose
KV is late or failed, and admits pending requests into free blocks. While requests wait for their
KV it wakes every POLL_S (and whenever the transfer thread says something arrived).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from executor.core.config import ConfigError
from executor.core.config.sections import DisaggConfig
from executor.core.engine import EngineStep, ExecutionEngine, RequestOutput
from executor.core.scheduler import Scheduler
from executor.online.disagg.bootstrap import BootstrapServer, register_rank
from executor.online.disagg.kv_copy import KVCopier
from executor.online.disagg.scheduler import DecodeDisaggScheduler, DisaggTicket, PrefillDisaggScheduler
from executor.online.disagg.transfer import TRANSFER_ERROR, DecodeTransfer, Prefilled, PrefillTransfer
from executor.online.engine_loop import EngineLoop, Update, update_of
from executor.types_ import Request
from executor.types_.kv_cache_spec import TPSplit

logger = logging.getLogger(__name__)

POLL_S = 0.01  # a decode loop's longest idle wait while requests wait for their KV


def role_scheduler(base: Scheduler, cls: type[Scheduler], **kwargs: Any) -> Any:
    """A role scheduler over the base one's limits, pool, EOS ids, clock and lookahead."""
    return cls(
        base.limits,
        base.kv_cache_manager,
        base.eos_token_ids,
        base.clock,
        num_lookahead_tokens=base.num_lookahead_tokens,
        **kwargs,
    )


class DisaggEngineLoop(EngineLoop):
    def __init__(self, engine: ExecutionEngine, max_waiting_requests: int, disagg: DisaggConfig) -> None:
        assert disagg.disaggregation_mode in ("PREFILL", "DECODE"), disagg.disaggregation_mode
        self.disagg = disagg
        self.role = disagg.disaggregation_mode.lower()
        self.copier = KVCopier(engine.worker)
        self.prefill_step_s = 0.0  # time in prefill steps, their number, the requests they prefilled (bench_pd)
        self.num_prefill_steps = 0
        self.num_prefilled = 0
        self._tickets: dict[str, DisaggTicket] = {}  # rank 0: submitted, not yet in a turn
        self._turn_tickets: dict[str, DisaggTicket] = {}  # under torchrun: the last turn's, on every rank
        self._request_of_room: dict[str, str] = {}
        if self.role == "prefill":
            scheduler = role_scheduler(engine.core.scheduler, PrefillDisaggScheduler)
            scheduler.on_prefilled = self._hand_over
            scheduler.on_failed = lambda ticket, why: self.prefill_transfer.fail(ticket.room, why)
        else:
            reserved = engine.config.scheduler_config.num_reserved_decode_tokens
            scheduler = role_scheduler(
                engine.core.scheduler, DecodeDisaggScheduler, num_reserved_decode_tokens=reserved
            )
            scheduler.on_admitted = self._want
            scheduler.on_dropped = self._dropped
        if engine.lock_step:  # a replica that skips a step while its KV comes would stall the others
            raise ConfigError(
                f"disagg_config.disaggregation_mode {disagg.disaggregation_mode} in {engine.config.source}: the "
                f"data-parallel replicas step in lock-step here ({', '.join(engine.lock_step_kinds)} span them), "
                "which a decode replica waiting for its KV cannot join; use replicas that step on their own"
            )
        engine.core.scheduler = scheduler
        super().__init__(engine, max_waiting_requests)
        self.bootstrap: BootstrapServer | None = None
        if self.role == "prefill":
            self.prefill_transfer = self._start_prefill_side()
        else:
            self.decode_transfer = DecodeTransfer(
                backend=disagg.transfer_backend,
                timeout_s=disagg.transfer_timeout_s,
                wake=self.wake,
                device=engine.platform.device,
            )
            self.decode_transfer.start()

    # -- set-up ---------------------------------------------------------------------------

    def _start_prefill_side(self) -> PrefillTransfer:
        """The store the pair groups meet on, this rank's transfer thread, and on the leader the
        Bootstrap server; under torchrun (attention tensor parallel) every rank registers its own
        transfer socket there, the leader's store and server announced to them over the world."""
        disagg = self.disagg
        self._check_joinable()
        host, port, creator = disagg.local_ip, 0, True
        if disagg.store_url:
            url = urlparse(disagg.store_url if "://" in disagg.store_url else f"tcp://{disagg.store_url}")
            host, port, creator = url.hostname or disagg.local_ip, url.port or 0, disagg.is_store_creator_node
        timeout = timedelta(seconds=disagg.transfer_timeout_s)
        leader = self.comm.rank == 0
        announced = None
        if leader:
            store = dist.TCPStore(host, port, is_master=creator, wait_for_workers=False, timeout=timeout)
            self.bootstrap = BootstrapServer(
                disagg.bootstrap_host, disagg.bootstrap_port, uuid.uuid4().hex[:12], self.comm.env.world_size
            )
            self.bootstrap.start()
            announced = (host, store.port, self.bootstrap.port)
        host, port, bootstrap_port = self.comm.broadcast_from_rank0(announced)
        if not leader:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        transfer = PrefillTransfer(
            disagg.local_ip,
            store,
            host,
            port,
            backend=disagg.transfer_backend,
            timeout_s=disagg.transfer_timeout_s,
            rank=self.comm.rank,
        )
        transfer.start()
        if self.bootstrap is not None:
            self.bootstrap.register(transfer.entry)
        else:
            register_rank(disagg.bootstrap_host, bootstrap_port, transfer.entry, disagg.transfer_timeout_s)
        logger.info(
            "prefill role, rank %d: bootstrap server %s:%d, KV transfer on %s (%s), store %s:%d",
            self.comm.rank,
            disagg.bootstrap_host,
            bootstrap_port,
            transfer.entry.endpoint,
            disagg.transfer_backend,
            host,
            port,
        )
        return transfer

    def _check_joinable(self) -> None:
        """Under attention tensor parallelism a decode rank joins the prefill ranks' shares of each
        cache tensor (kv_copy.assemble): refuse, before any request, a tensor it cannot join."""
        if self.comm.layout.attn_tp_size == 1:
            return
        for group in self.engine.worker.kv_cache_groups:
            for spec in group.spec.tensors:
                if spec.tp_split is TPSplit.OTHER:
                    layers = ", ".join(group.layer_names[:2]) + (", ..." if len(group.layer_names) > 2 else "")
                    raise ConfigError(
                        f"disagg_config.disaggregation_mode PREFILL in {self.engine.config.source}: at attn_tp_size "
                        f"{self.comm.layout.attn_tp_size} the KV cache tensor {spec.name!r} (layers {layers}) is "
                        "split over the ranks in a way a decode instance does not join (only heads, runs and whole "
                        "tensors are); run the prefill at attn_tp_size 1"
                    )

    # -- the HTTP side ----------------------------------------------------------------------

    def submit_disagg(self, request: Request, sink: Callable[[Update], None], ticket: DisaggTicket) -> None:
        """As submit, with the request's ticket; on a prefill instance it runs its prompt and first token only."""
        if self.role == "prefill":
            request.sampling_params = dataclasses.replace(request.sampling_params, max_new_tokens=1)
        with self._wake:
            self._tickets[request.request_id] = ticket
        try:
            self.submit(request, sink)
        except BaseException:
            with self._wake:
                self._tickets.pop(request.request_id, None)
            raise

    def bootstrap_info(self) -> dict[str, Any]:
        """What the Router asks a prefill instance for: where its Bootstrap server is."""
        port = self.bootstrap.port if self.bootstrap is not None else self.disagg.bootstrap_port
        return {"role": self.role, "bootstrap_host": self.disagg.bootstrap_host, "bootstrap_port": port}

    def transfer_stats(self) -> dict[str, float | int]:
        transfer = self.prefill_transfer if self.role == "prefill" else self.decode_transfer
        stats: dict[str, float | int] = transfer.stats.as_dict()
        stats |= {
            "prefill_steps": self.num_prefill_steps,
            "prefill_step_s": self.prefill_step_s,
            "prefilled_requests": self.num_prefilled,
        }
        if self.role == "decode":
            scheduler = self.core.scheduler
            stats |= {"num_in_transfer": scheduler.num_in_transfer, "retractions": scheduler.num_retractions}
        else:
            stats |= {"kv_held": self.prefill_transfer.num_held}
        return stats

    def stop(self, timeout_s: float | None = None) -> None:
        super().stop(timeout_s)
        if self.role == "prefill":
            self.prefill_transfer.stop()
            if self.bootstrap is not None:
                self.bootstrap.stop()
        else:
            self.decode_transfer.stop()

    # -- the engine's thread ------------------------------------------------------------------

    def _next_turn(self) -> Any:
        """The base loop's turn; under torchrun (a decode instance of data-parallel replicas) rank 0
        then sends the turn's tickets to every rank, each replica keeping its requests'."""
        turn = super()._next_turn()
        if self.comm.is_distributed and turn.requests:
            tickets = None
            if self.comm.rank == 0:
                with self._wake:
                    ids = [request.request_id for request, _ in turn.requests]
                    tickets = {rid: self._tickets.pop(rid) for rid in ids if rid in self._tickets}
            self._turn_tickets = self.comm.broadcast_from_rank0(tickets)
        return turn

    def _apply(self, turn: Any) -> None:
        with self._wake:
            for request, replica in turn.requests:
                if self.comm.is_distributed:
                    ticket = self._turn_tickets.get(request.request_id)
                else:
                    ticket = self._tickets.pop(request.request_id, None)
                if ticket is not None and replica == self.comm.dp_rank:
                    self.core.scheduler.tickets[request.request_id] = ticket
        super()._apply(turn)

    def _idle_wait_s(self) -> float | None:
        """Short while requests wait for their KV here, or (data-parallel replicas) are in flight on
        another replica, whose arrivals and steps wait for rank 0's next turn."""
        waiting_elsewhere = self.comm.is_distributed and self.num_in_flight > 0
        if self.role == "decode" and (self.core.scheduler.num_in_transfer or waiting_elsewhere):
            return POLL_S
        return super()._idle_wait_s()

    def _step(self) -> list[Update]:
        transfer = self.prefill_transfer if self.role == "prefill" else self.decode_transfer
        if transfer.error is not None:  # the loop stops: /health says why, requests get 503
            raise RuntimeError(f"the KV transfer thread stopped: {type(transfer.error).__name__}: {transfer.error}")
        if self.role == "prefill":
            return super()._step()
        updates = self._take_arrivals()
        scheduler: DecodeDisaggScheduler = self.core.scheduler
        for request_id in scheduler.expired(self.disagg.transfer_timeout_s):
            ticket = scheduler.ticket_of(request_id)
            assert ticket is not None
            scheduler.fail_transfer(
                request_id,
                f"{TRANSFER_ERROR}: its KV did not arrive within disagg_config.transfer_timeout_s = "
                f"{self.disagg.transfer_timeout_s:g} s "
                f"(prefill bootstrap {ticket.bootstrap_host}:{ticket.bootstrap_port})",
                timed_out=True,
            )
        scheduler.admit_pending()
        if scheduler.transferring and scheduler.waiting and not scheduler.running and not scheduler.has_failed():
            return updates  # a retracted request waits for blocks that arriving requests will free as they finish
        return updates + super()._step()

    def _update_stats(self, step: EngineStep) -> None:
        super()._update_stats(step)
        if step.record is not None and step.record.phase == "prefill":
            self.prefill_step_s += step.record.step_time_ms / 1e3
            self.num_prefill_steps += 1

    def _hand_over(self, request: Request, ticket: DisaggTicket, rows: list[list[int]]) -> None:
        """Prefill role: the request's prompt is prefilled and its first token sampled; gather its
        KV (before its blocks are freed) for the transfer thread to send."""
        self.num_prefilled += 1
        metas, buffer = self.copier.gather(rows)
        self.prefill_transfer.publish(
            Prefilled(
                ticket.room,
                list(request.output_token_ids),
                list(request.output_logprobs),
                list(request.prompt_logprobs),
                metas,
                buffer,
            )
        )

    def _want(self, request: Request, ticket: DisaggTicket, rows: list[list[int]]) -> None:
        self._request_of_room[ticket.room] = request.request_id
        self.decode_transfer.want(ticket.room, (ticket.bootstrap_host, ticket.bootstrap_port), rows)

    def _dropped(self, ticket: DisaggTicket, timed_out: bool) -> None:
        if self._request_of_room.pop(ticket.room, None) is not None:
            self.decode_transfer.drop(ticket.room, timed_out)

    def _take_arrivals(self) -> list[Update]:
        """Decode role: apply what the transfer thread received since the last step."""
        scheduler: DecodeDisaggScheduler = self.core.scheduler
        updates: list[Update] = []
        while True:
            try:
                arrival = self.decode_transfer.arrivals.get_nowait()
            except queue.Empty:
                return updates
            request_id = self._request_of_room.pop(arrival.room, None)
            if request_id is None or request_id not in scheduler.transferring:
                continue  # ended here meanwhile (aborted, timed out): received, and dropped
            if arrival.error is not None:
                scheduler.fail_transfer(request_id, arrival.error)
                continue
            assert arrival.buffer is not None
            try:
                rows = scheduler.kv_cache_manager.get_block_ids(request_id)
                self.copier.scatter(arrival.metas, arrival.buffer, rows)
            except ValueError as exc:
                scheduler.fail_transfer(request_id, f"{TRANSFER_ERROR}: {exc}")
                continue
            request = scheduler.kv_arrived(
                request_id, arrival.first_token_ids, arrival.logprobs, arrival.prompt_logprobs
            )
            output = RequestOutput(request, list(request.output_token_ids), list(request.output_logprobs))
            if self.comm.is_dp_leader:
                updates.append(update_of(output))
