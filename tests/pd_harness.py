"""A prefill and a decode instance in this process (their engine loops on threads, no HTTP), joined
by the real KV transfer (ZMQ control, gloo pair group), for the disaggregation tests."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass

from executor.core.config.sections import DisaggConfig
from executor.core.engine import ExecutionEngine
from executor.online.disagg.loop import DisaggEngineLoop
from executor.online.disagg.scheduler import DisaggTicket
from executor.online.engine_loop import EngineLoop, Update
from executor.types_ import Request, SamplingParams

WAIT_S = 120.0  # the longest a test waits for a request's end


@dataclass(slots=True)
class Outcome:
    token_ids: list[int]
    finish_reason: str
    error: str | None


@dataclass(slots=True)
class PDPair:
    prefill: DisaggEngineLoop
    decode: DisaggEngineLoop
    _rooms: int = 0

    @property
    def bootstrap(self) -> tuple[str, int]:
        info = self.prefill.bootstrap_info()
        return info["bootstrap_host"], info["bootstrap_port"]

    def submit(self, prompt: list[int], params: SamplingParams, *, prefill: bool = True) -> queue.Queue[Update]:
        """Send a request to both instances, as the Router does (`prefill` False: to decode only)."""
        self._rooms += 1
        room = str(self._rooms)
        ticket = DisaggTicket(room, *self.bootstrap)
        updates: queue.Queue[Update] = queue.Queue()
        if prefill:
            self.prefill.submit_disagg(
                Request(f"p{room}", None, list(prompt), dataclasses.replace(params)), lambda update: None, ticket
            )
        self.decode.submit_disagg(Request(f"d{room}", None, list(prompt), params), updates.put, ticket)
        return updates

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Outcome]:
        """All at once; each request's outcome, in order."""
        return [wait(updates) for updates in [self.submit(prompt, params) for prompt in prompts]]


def wait(updates: queue.Queue[Update], timeout_s: float = WAIT_S) -> Outcome:
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        update = updates.get(timeout=max(deadline - time.monotonic(), 0.01))
        tokens += update.new_token_ids
        if update.finish_reason is not None:
            return Outcome(tokens, update.finish_reason, update.error)


def pools_empty(*loops: EngineLoop, timeout_s: float = 10.0) -> bool:
    """Every block of each loop's pool free again (waits a little for the loops to settle)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(loop.core.scheduler.kv_cache_manager.block_pool.num_used_blocks == 0 for loop in loops):
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def pd_pair(
    prefill_engine: ExecutionEngine, decode_engine: ExecutionEngine, *, timeout_s: float = 20.0
) -> Iterator[PDPair]:
    prefill = DisaggEngineLoop(
        prefill_engine, 64, DisaggConfig("PREFILL", bootstrap_port=0, transfer_timeout_s=timeout_s)
    )
    decode = DisaggEngineLoop(
        decode_engine,
        64,
        DisaggConfig("DECODE", bootstrap_port=prefill.bootstrap_info()["bootstrap_port"], transfer_timeout_s=timeout_s),
    )
    prefill.start()
    decode.start()
    try:
        yield PDPair(prefill, decode)
    finally:
        decode.stop(timeout_s=15)
        prefill.stop(timeout_s=15)
