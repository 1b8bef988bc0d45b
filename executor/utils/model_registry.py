"""Finding a model's code from model_config.model_name: the package models/<name>/.

A model package exports `model_cls` (the torch module) and `config_cls` (its HF config class).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import models


def available_models() -> list[str]:
    root = Path(models.__file__).parent
    return sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def check_model_name(model_name: str, source: str) -> None:
    """Fail before anything loads when models/<model_name>/ does not exist."""
    from executor.core.config import ConfigError

    if model_name not in available_models():
        raise ConfigError(
            f"model_config.model_name {model_name!r} in {source}: no such folder under models/; "
            f"available: {', '.join(available_models())}"
        )


def resolve_model(model_name: str) -> tuple[type, Any]:
    package = importlib.import_module(f"models.{model_name}")
    return package.model_cls, package.config_cls


def model_dir(model_name: str) -> Path:
    return Path(models.__file__).parent / model_name
