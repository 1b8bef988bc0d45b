"""StepTimer: one step's wall time, and its split into consecutive parts when the breakdown is on.

The scheduler starts a step and stops it; the engine, worker and graph runner mark where each part
ends, so the parts add up to the step's time by construction. On CPU a mark is a clock read; on an
asynchronous device (CUDA, NPU) a mark first waits for the device, so that each part owns the
device work it queued. That wait costs host/device overlap, so there it is only done when asked
for (model_config.step_breakdown; docs/profiling.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
