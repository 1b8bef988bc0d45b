"""Where the harness keeps what it fetches and builds on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def infer_recipes_home() -> Path:
    """`$INFER_RECIPES_HOME`, else ~/.cache/infer-recipes: where models, downloads and compile caches are kept."""
    return Path(os.environ.get("INFER_RECIPES_HOME") or "~/.cache/infer-recipes").expanduser()
