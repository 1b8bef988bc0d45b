"""Where a run's step lines go: every one to the run folder's steps.log (steps_dp<d>.log for
replica d; ours and cann-recipes' worded `[Main] Inference time (...)` line, so its log parsers
see every step), and to the console
only on a cadence (about CONSOLE_STEP_LINES a run unless scheduler_config.console_step_interval
says), so that the generated texts are not lost between them. steps.jsonl keeps every step too.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

from executor.core.engine import StepRecord

CONSOLE_STEP_LINES = 40

step_logger = logging.getLogger("executor.steps")


def console_step_interval(configured: int, num_requests: int, batch_size: int, max_new_tokens: int) -> int:
    """`configured`, or where it is 0 the interval that shows about CONSOLE_STEP_LINES step lines
    over a run's estimated steps (a prefill and max_new_tokens decode steps per batch of requests)."""
    if configured:
        return configured
    estimated_steps = math.ceil(num_requests / max(batch_size, 1)) * (1 + max_new_tokens)
    return max(1, math.ceil(estimated_steps / CONSOLE_STEP_LINES))


class StepLog:
    """Writes each step's lines to the step text file (while entered; it may be entered again, for
    the closing lines; a resumed run's parts follow each other) and logs the ones on the console's
    cadence. The file is written here, not through logging, so that the console's handler sees
    only the lines it shows."""

    def __init__(self, text_path: Path | None, console_interval: int) -> None:
        self.console_interval = console_interval
        self.text_path = text_path
        self._file: TextIO | None = None

    def __enter__(self) -> StepLog:
        if self.text_path is not None:
            self._file = open(self.text_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def record(self, record: StepRecord) -> None:
        line = record.log_line()
        if (record.step - 1) % self.console_interval == 0:
            step_logger.info(line)
        self._write([line, record.cann_log_line()])

    def cann_lines(self, lines: list[str]) -> None:
        """cann-recipes' own closing lines: steps.log only (the console's end table says the same)."""
        self._write(lines)

    def _write(self, lines: list[str]) -> None:
        if self._file is not None:
            stamp = time.strftime("%H:%M:%S")
            self._file.write("".join(f"{stamp} {line}\n" for line in lines))
            self._file.flush()
