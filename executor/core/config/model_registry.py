"""Finding a model's code from model_config.model_name.

The name is a folder under models/ or one of the cann-recipes names a folder's package lists in
its `model_names` (cann-recipes keeps the folder apart from the model's name); empty means the
default folder that models/__init__.py names. A package exports `model_cls` (the torch module),
`config_cls` (its HF config class) and `model_names`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import models


def available_models() -> list[str]:
    """The model folders: packages under models/."""
    root = Path(models.__file__).parent
    return sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def model_names_by_folder() -> dict[str, tuple[str, ...]]:
    """Each folder's cann-recipes names, read from its package."""
    return {
        folder: tuple(getattr(importlib.import_module(f"models.{folder}"), "model_names", ()))
        for folder in available_models()
    }


def model_folder(model_name: str) -> str:
    """The folder under models/ that serves model_name (ValueError when none does)."""
    if not model_name:
        return models.DEFAULT_MODEL_FOLDER
    if model_name in available_models():
        return model_name
    by_folder = model_names_by_folder()
    for folder, names in by_folder.items():
        if model_name in names:
            return folder
    if model_name in models.NOT_BUILT:
        raise ValueError(f"its architecture is not built here: {models.NOT_BUILT[model_name]}")
    names = sorted(name for names in by_folder.values() for name in names)
    raise ValueError(
        f"no folder under models/ and no model name of one; available folders: {', '.join(by_folder)}; "
        f"model names: {', '.join(names) or 'none'}"
    )


def check_model_name(model_name: str, source: str) -> None:
    """Fail before anything loads when no folder serves model_name."""
    from executor.core.config import ConfigError

    try:
        model_folder(model_name)
    except ValueError as exc:
        raise ConfigError(f"model_config.model_name {model_name!r} in {source}: {exc}") from None


def resolve_model(model_name: str) -> tuple[type, Any]:
    package = importlib.import_module(f"models.{model_folder(model_name)}")
    return package.model_cls, package.config_cls


def resolve_eagle3_drafter(model_name: str) -> type:
    """The EAGLE-3 drafter class of model_name's family (its package's `eagle3_drafter_cls`);
    ValueError when the family has none."""
    folder = model_folder(model_name)
    drafter_cls = getattr(importlib.import_module(f"models.{folder}"), "eagle3_drafter_cls", None)
    if drafter_cls is None:
        families = [
            name
            for name in available_models()
            if hasattr(importlib.import_module(f"models.{name}"), "eagle3_drafter_cls")
        ]
        raise ValueError(f"models/{folder} has no EAGLE-3 drafter here (families with one: {', '.join(families)})")
    return drafter_cls


def model_dir(model_name: str) -> Path:
    return Path(models.__file__).parent / model_folder(model_name)
