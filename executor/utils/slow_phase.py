"""Start-up phases that say what they are doing once they take long enough to look like a hang
(a first kernel build, weights from a slow disk, a graph compile), and stay silent when quick."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

# Seconds after which a phase still running says what it is.
SLOW_AFTER_S = 2.0


@contextlib.contextmanager
def announced_if_slow(logger: logging.Logger, doing: str, after_s: float = SLOW_AFTER_S) -> Iterator[None]:
    """Log `doing` once the phase has run `after_s` seconds, then how long it took when it ends;
    nothing when it ends sooner."""
    start_s = time.perf_counter()
    notice = threading.Timer(after_s, logger.info, (f"{doing} ...",))
    notice.daemon = True
    notice.start()
    try:
        yield
    finally:
        notice.cancel()
        notice.join()  # no timer thread outlives its phase (none is left running at exit)
        elapsed_s = time.perf_counter() - start_s
        if elapsed_s >= after_s:  # the notice was given: say when it is over
            logger.info("%s: done in %.1f s", doing, elapsed_s)
