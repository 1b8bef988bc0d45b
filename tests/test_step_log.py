"""The step log's cadence on the console (executor/offline/offline_inference.py): about 40
step lines a run, none of cann-recipes' worded ones, while steps.log gets every step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from executor.core.engine import StepRecord
from executor.offline.durable_io import OutputWriteError
from executor.offline.offline_inference import CONSOLE_STEP_LINES, StepLog, console_step_interval
from executor.offline.results import ResultWriter
from executor.offline.run_folder import StepFiles, plan_run
from tests.engine_harness import make_inference, token_records


def test_the_interval_spreads_about_forty_lines_over_the_estimated_steps():
    assert console_step_interval(7, 1000, 4, 100) == 7  # as configured
    assert console_step_interval(0, 2, 4, 10) == 1  # a short run shows every step
    interval = console_step_interval(0, 45, 32, 64)  # two batches of 65 steps
    assert 130 / interval <= CONSOLE_STEP_LINES < 130 / (interval - 1)  # the smallest interval that fits


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_console_shows_steps_on_the_cadence_and_steps_log_has_every_one(tiny_llama_dir, tmp_path):
    records = token_records([[5 + i, 6, 7] for i in range(6)])
    inference = make_inference(tiny_llama_dir, batch_size=2, max_new_tokens=30, ignore_eos=True)
    console = Lines()
    root = logging.getLogger()
    root.addHandler(console)
    level = root.level
    root.setLevel(logging.INFO)
    writer = ResultWriter(plan_run(tmp_path / "out", inference.config, records), inference.config)
    try:
        steps = inference.generate(records, writer).steps
    finally:
        writer.close()
        root.removeHandler(console)
        root.setLevel(level)
    shown = [m for m in console.messages if m.startswith("step ")]
    interval = console_step_interval(0, len(records), 2, 30)
    assert interval > 1 and len(shown) == len(range(0, len(steps), interval)) <= CONSOLE_STEP_LINES + 1
    assert not any("[Main]" in m for m in console.messages)
    text = (tmp_path / "out" / "steps.log").read_text()
    assert text.count("[Main] Inference time") == len(steps) and text.count("| decode ") + text.count(
        "| prefill"
    ) == len(steps)


def test_a_step_file_that_cannot_be_written_is_named_in_one_line(tmp_path):
    files = StepFiles(text=tmp_path / "steps.log", jsonl=Path("/dev/full"), part=1)  # every write: ENOSPC
    step = StepRecord(1, "decode", 1, 1, 1.0, 0.1, 1, 0.0, 0, 0)
    with pytest.raises(OutputWriteError) as error, StepLog(files, console_interval=1) as log:
        log.record(step)
    assert str(error.value) == "[Errno 28] cannot write /dev/full: No space left on device"
    assert (tmp_path / "steps.log").read_text().count("[Main] Inference time") == 1  # the text line went first
