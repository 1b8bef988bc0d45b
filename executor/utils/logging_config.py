"""setup_logging(): one format for every module; INFER_RECIPES_LOG_LEVEL picks the level."""

from __future__ import annotations

import logging
import os


def setup_logging() -> None:
    level = os.environ.get("INFER_RECIPES_LOG_LEVEL", "INFO").upper()
    rank = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""  # under torchrun
    logging.basicConfig(
        level=level, format=f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
