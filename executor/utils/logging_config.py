"""setup_logging(): one format for every module; INFER_RECIPES_LOG_LEVEL picks the level."""

from __future__ import annotations

import logging
import os


def setup_logging() -> None:
    level = os.environ.get("INFER_RECIPES_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
