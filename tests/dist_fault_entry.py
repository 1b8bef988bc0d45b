"""A torchrun entry for the failure tests: the offline entry, with rank FAULT_RANK raising at its
FAULT_CALL-th ModelRunner.execute (the warm-up makes two; the fourth is the run's second step), or at the
call that the environment variable FAULT_CALL_ENV names; with FAULT_KILL_ENV set, killing itself there
with SIGKILL instead (a rank lost to the OOM killer, say)."""

from __future__ import annotations

import os
import signal
import sys

from executor.core.engine.model_runner import ModelRunner
from executor.offline.__main__ import main
from executor.types_ import Batch, StepResult

FAULT_RANK = 1
FAULT_CALL = 4
FAULT_MESSAGE = "injected fault for the failure test"
FAULT_CALL_ENV = "INFER_RECIPES_TEST_FAULT_CALL"
FAULT_KILL_ENV = "INFER_RECIPES_TEST_FAULT_KILL"


def install_fault() -> None:
    if int(os.environ["RANK"]) != FAULT_RANK:
        return
    original = ModelRunner.execute
    fault_call = int(os.environ.get(FAULT_CALL_ENV, FAULT_CALL))
    calls = 0

    def failing(self: ModelRunner, batch: Batch) -> StepResult:
        nonlocal calls
        calls += 1
        if calls == fault_call and os.environ.get(FAULT_KILL_ENV):
            os.kill(os.getpid(), signal.SIGKILL)
        if calls == fault_call:
            raise RuntimeError(FAULT_MESSAGE)
        return original(self, batch)

    ModelRunner.execute = failing


if __name__ == "__main__":
    install_fault()
    sys.exit(main())
