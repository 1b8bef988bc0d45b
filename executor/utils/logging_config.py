"""setup_logging(): one format for every module; INFER_RECIPES_LOG_LEVEL picks the level; the
console shows the step log on its cadence (executor/offline/step_log.py) and none of the
cann-recipes-worded lines, which the run folder's steps.log holds."""

from __future__ import annotations

import logging
import os

STEP_LOGGER = "executor.steps"
CANN_STEP_LOGGER = "executor.steps.cann"
ON_CONSOLE = "on_console"  # a step line's record attribute: whether the console shows it


class ConsoleFilter(logging.Filter):
    """What the console leaves out: cann-recipes' worded step lines, step lines off the cadence, and
    step lines below the root's level (the step logger passes every step on, for steps.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == CANN_STEP_LOGGER or record.levelno < logging.getLogger().getEffectiveLevel():
            return False
        return getattr(record, ON_CONSOLE, True)


def setup_logging() -> None:
    """Configure the root logger once, with a console handler of our own; a process whose root
    already has handlers (a test runner, an embedding program) keeps them as they are."""
    root = logging.getLogger()
    level = os.environ.get("INFER_RECIPES_LOG_LEVEL", "INFO").upper()
    rank = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""  # under torchrun
    if not root.handlers:
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter(f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        console.addFilter(ConsoleFilter())
        root.addHandler(console)
        root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
