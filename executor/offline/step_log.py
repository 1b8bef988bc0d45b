"""Where a run's step lines go: every one to the run folder's steps.log (steps_dp<d>.log for
replica d; ours and cann-recipes' worded `[Main] Inference time (...)` line, so its log parsers
see every step), and to the console
only on a cadence (about CONSOLE_STEP_LINES a run unless scheduler_config.console_step_interval
says), so that the generated texts are not lost between them. steps.jsonl keeps every step too.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import TracebackType

from executor.core.engine import StepRecord
from executor.utils.logging_config import CANN_STEP_LOGGER, ON_CONSOLE, STEP_LOGGER

CONSOLE_STEP_LINES = 40

step_logger = logging.getLogger(STEP_LOGGER)
cann_step_logger = logging.getLogger(CANN_STEP_LOGGER)


def console_step_interval(configured: int, num_requests: int, batch_size: int, max_new_tokens: int) -> int:
    """`configured`, or where it is 0 the interval that shows about CONSOLE_STEP_LINES step lines
    over a run's estimated steps (a prefill and max_new_tokens decode steps per batch of requests)."""
    if configured:
        return configured
    estimated_steps = math.ceil(num_requests / max(batch_size, 1)) * (1 + max_new_tokens)
    return max(1, math.ceil(estimated_steps / CONSOLE_STEP_LINES))


class StepLog:
    """Logs each step's record; with a run folder, appends to its step text file while entered
    (it may be entered again, for the closing lines; a resumed run's parts follow each other)."""

    def __init__(self, text_path: Path | None, console_interval: int) -> None:
        self.console_interval = console_interval
        self.text_path = text_path
        self._file: logging.FileHandler | None = None
        self._level = logging.NOTSET

    def __enter__(self) -> StepLog:
        # Every step reaches the file whatever the console's level (ConsoleFilter keeps to that).
        self._level = step_logger.level
        step_logger.setLevel(logging.INFO)
        if self.text_path is not None:
            self._file = logging.FileHandler(self.text_path, mode="a", encoding="utf-8")
            self._file.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
            step_logger.addHandler(self._file)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._file is not None:
            step_logger.removeHandler(self._file)
            self._file.close()
            self._file = None
        step_logger.setLevel(self._level)

    def record(self, record: StepRecord) -> None:
        shown = (record.step - 1) % self.console_interval == 0
        step_logger.info(record.log_line(), extra={ON_CONSOLE: shown})
        cann_step_logger.info(record.cann_log_line())

    def cann_lines(self, lines: list[str]) -> None:
        """cann-recipes' own closing lines: steps.log only (the console's end table says the same)."""
        for line in lines:
            cann_step_logger.info(line)
