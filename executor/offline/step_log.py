"""Where a run's step records go: every one to the run folder's steps.jsonl (one JSON line each,
steps_dp<d>.jsonl for replica d) and steps.log (ours and cann-recipes' worded `[Main] Inference
time (...)` line, so its log parsers see every step), and to the console only on a cadence (about
CONSOLE_STEP_LINES a run unless scheduler_config.console_step_interval says), so that the
generated texts are not lost between them.

Both files are appended with whole lines and not synced: a crash may lose the last few steps (they
only time the run) or cut the last line short, which the next part of the run drops (ResultWriter).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

from executor.core.engine import StepRecord
from executor.offline.durable_io import write_error

CONSOLE_STEP_LINES = 40

step_logger = logging.getLogger("executor.steps")


def console_step_interval(configured: int, num_requests: int, batch_size: int, max_new_tokens: int) -> int:
    """`configured`, or where it is 0 the interval that shows about CONSOLE_STEP_LINES step lines
    over a run's estimated steps (a prefill and max_new_tokens decode steps per batch of requests)."""
    if configured:
        return configured
    estimated_steps = math.ceil(num_requests / max(batch_size, 1)) * (1 + max_new_tokens)
    return max(1, math.ceil(estimated_steps / CONSOLE_STEP_LINES))


@dataclass(frozen=True, slots=True)
class StepFiles:
    """One replica's step files in its run folder, and the part of the run its lines belong to."""

    text: Path  # steps.log
    jsonl: Path  # steps.jsonl
    part: int


class StepLog:
    """Writes each step to the step files (while entered; it may be entered again, for the closing
    lines; a resumed run's parts follow each other) and logs the steps on the console's cadence.
    The files are written here, not through logging, so that the console's handler sees only the
    lines it shows."""

    def __init__(self, files: StepFiles | None, console_interval: int) -> None:
        self.console_interval = console_interval
        self.files = files
        self._text: TextIO | None = None
        self._jsonl: TextIO | None = None

    def __enter__(self) -> StepLog:
        if self.files is not None:
            self._text = self._open(self.files.text)
            self._jsonl = self._open(self.files.jsonl)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        files, self._text, self._jsonl = (self._text, self._jsonl), None, None
        for file in files:
            if file is None:
                continue
            try:
                file.close()  # flushes what a failed write left in the buffer, and may fail the same way
            except OSError as exc:
                if error is None:
                    raise write_error(Path(file.name), exc) from None

    def record(self, record: StepRecord) -> None:
        line = record.log_line()
        if (record.step - 1) % self.console_interval == 0:
            step_logger.info(line)
        if self.files is not None:
            self._write_text([line, record.cann_log_line()])
            line = json.dumps({"part": self.files.part, **dataclasses.asdict(record)})
            self._write(self._jsonl, self.files.jsonl, line)

    def cann_lines(self, lines: list[str]) -> None:
        """cann-recipes' own closing lines: steps.log only (the console's end table says the same)."""
        if self.files is not None:
            self._write_text(lines)

    def _write_text(self, lines: list[str]) -> None:
        assert self.files is not None
        stamp = time.strftime("%H:%M:%S")
        self._write(self._text, self.files.text, "\n".join(f"{stamp} {line}" for line in lines))

    @staticmethod
    def _open(path: Path) -> TextIO:
        try:
            return open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        except OSError as exc:
            raise write_error(path, exc) from None

    @staticmethod
    def _write(file: TextIO | None, path: Path, text: str) -> None:
        """`text` and a newline as whole lines (one write of the flushed buffer), or a one-line error
        naming the file."""
        assert file is not None, "the step log is written while entered"
        try:
            file.write(text + "\n")
            file.flush()
        except OSError as exc:
            raise write_error(path, exc) from None
