"""setup_logging(): one format for every module; INFER_RECIPES_LOG_LEVEL picks the level. The
step log (executor/offline/offline_inference.py) logs only the step lines the console shows; the run
folder's steps.log, written there, holds every one and cann-recipes' worded lines."""

from __future__ import annotations

import logging
import os


def setup_logging() -> None:
    """Configure the root logger once, with a console handler of our own; a process whose root
    already has handlers (a test runner, an embedding program) keeps them as they are."""
    root = logging.getLogger()
    level = os.environ.get("INFER_RECIPES_LOG_LEVEL", "INFO").upper()
    rank = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""  # under torchrun
    if not root.handlers:
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter(f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(console)
        root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
