"""The exit statuses of `python -m executor.offline`, so that scripts can tell outcomes apart.

docs/resuming.md lists them; an interrupted run exits with 128 + the signal number (interrupts.py).
"""

from __future__ import annotations

from typing import Any

ALL_SERVED = 0
STOPPED_ON_ERROR = 1  # the run met an error after it started (disk full, ...); finished lines are kept
COULD_NOT_START = 2  # bad config, dataset, model folder, device or output folder; no model was loaded
SOME_FAILED = 3  # the run finished; some requests failed alone (their reasons are in outputs.jsonl)
ALL_FAILED = 4  # the run finished; every request failed


def finished_run_status(summary: dict[str, Any]) -> int:
    """The status of a run that served every request it was given (summary.json of the whole run)."""
    if summary["failed_requests"] == 0:
        return ALL_SERVED
    return ALL_FAILED if summary["failed_requests"] == summary["requests"] else SOME_FAILED
