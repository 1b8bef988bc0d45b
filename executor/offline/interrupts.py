"""Ctrl-C and SIGTERM: stop cleanly, so that the run folder says what happened and can be resumed.

While requests are being served, the first signal asks the loop to stop after the step under way
(requests not finished are abandoned: they have no outputs line, and a resumed run serves them).
Before that, or on a second signal, the run stops at once. Exit status is 128 + the signal number:
130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """Raised from the signal handler when the run must stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status_for(signum: int) -> int:
    return 128 + signum


class StopSignals:
    """Installs the handlers for its `with` block and restores the previous ones after."""

    def __init__(self) -> None:
        self.signum: int | None = None
        # Set by the first signal; the step loop polls is_set (a flag read, no call into this module).
        self.stop_requested = threading.Event()
        self._deferred = False
        self._settled = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        # Python runs signal handlers in the main thread only; elsewhere (an embedding app) leave them be.
        in_main_thread = threading.current_thread() is threading.main_thread()
        handlers = HANDLED_SIGNALS if in_main_thread else ()
        self._previous = {signum: signal.signal(signum, self._handle) for signum in handlers}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within this block the first signal only sets `stop_requested`; the loop polls it between steps."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False

    def settle(self) -> None:
        """The run's outcome is decided (it is stopping, its exit status known): from here to the
        process's end a signal only sets `stop_requested`, so that torchrun's SIGTERM to a rank already
        stopping because another was lost, or its forward of the terminal's Ctrl-C that the rank got
        already, adds no traceback to the rank's one line."""
        self._settled = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
            self.stop_requested.set()
        if self._settled:
            return
        if first and self._deferred:
            logger.warning(
                "%s: finishing the current step, then stopping (again to stop at once)", signal.Signals(signum).name
            )
            return
        raise RunInterrupted(self.signum or signum)
