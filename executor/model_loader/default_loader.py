"""Load a Hugging Face safetensors checkpoint (one file or shards with an index) into a model.

The loader only finds files and yields (name, tensor) pairs lazily; the model's `load_weights` maps
names to parameters, so the loader knows no model. It then checks that nothing was left unfilled.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from executor.model_loader.base_loader import BaseModelLoader
from executor.model_loader.errors import WeightLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_NAMES_SHOWN = 10


def checkpoint_shards(model_path: Path) -> Mapping[Path, list[str] | None]:
    """Map each safetensors file to the tensor names to read from it (None: all of them)."""
    if not model_path.is_dir():
        raise WeightLoadError(f"model folder {model_path} does not exist or is not a folder")
    index_path = model_path / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shards: defaultdict[Path, list[str]] = defaultdict(list)
        for name, file_name in weight_map.items():
            shards[model_path / file_name].append(name)
        for shard in shards:
            if not shard.is_file():
                raise WeightLoadError(f"shard {shard} named by {index_path} is missing")
        return shards
    if (model_path / SINGLE_FILE).is_file():
        return {model_path / SINGLE_FILE: None}
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_path}")


def safetensors_weights(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so that peak memory stays near one tensor."""
    for shard, names in checkpoint_shards(Path(model_path)).items():
        with safe_open(str(shard), framework="pt") as file:
            available = set(file.keys())
            for name in names if names is not None else file.keys():
                if name not in available:
                    raise WeightLoadError(f"tensor {name!r} is listed for {shard} but is not in it")
                yield name, file.get_tensor(name)


def _name_list(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    more = len(names) - MAX_NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


class DefaultModelLoader(BaseModelLoader):
    def load_weights(self, model: torch.nn.Module, model_path: str) -> None:
        loaded = model.load_weights(safetensors_weights(model_path))
        missing = [name for name, _ in model.named_parameters() if name not in loaded]
        if missing:
            model_name = type(model).__name__
            raise WeightLoadError(
                f"{len(missing)} parameter(s) of {model_name} not found in {model_path}: {_name_list(missing)}"
            )
