"""Load a Hugging Face safetensors checkpoint (one file or shards with an index) into a model.

The loader only finds files and yields (name, CheckpointTensor) pairs: each tensor's shape and dtype,
read from the file only where a layer's weight_loader materializes it, and then only the shard that
this rank holds (checkpoint_tensor.py, module/weights.py). The model's `load_weights` maps names to parameters, so the
loader knows no model. It then checks that nothing was left unfilled.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from executor.model_loader.base_loader import BaseModelLoader
from executor.model_loader.layer_cut import layer_cut
from executor.types_.checkpoint_tensor import CheckpointTensor
from executor.types_.errors import WeightLoadError
from module.quantized import checkpoint_tensor_name

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_NAMES_SHOWN = 10
# safetensors' dtype names (PySafeSlice.get_dtype) -> torch's
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


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


def lazy_tensor(file, name: str) -> CheckpointTensor:
    """Tensor `name` of an open safetensors file, read only when (and as far as) it is materialized."""
    tensor_slice = file.get_slice(name)
    dtype_name = tensor_slice.get_dtype()
    dtype = SAFETENSORS_DTYPES.get(dtype_name)
    if dtype is None:
        raise WeightLoadError(f"tensor {name!r} has dtype {dtype_name}, which this loader does not know")
    return CheckpointTensor(tensor_slice.__getitem__, tensor_slice.get_shape(), dtype)


def safetensors_weights(model_path: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (name, CheckpointTensor) one tensor at a time; nothing is read until a weight_loader
    materializes its shard, so peak memory stays near one shard."""
    for shard, names in checkpoint_shards(Path(model_path)).items():
        with safe_open(str(shard), framework="pt") as file:
            available = set(file.keys())
            for name in names if names is not None else file.keys():
                if name not in available:
                    raise WeightLoadError(f"tensor {name!r} is listed for {shard} but is not in it")
                yield name, lazy_tensor(file, name)


def checkpoint_header(model_path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's (shape, safetensors dtype name), read from the headers only."""
    header = {}
    for shard, names in checkpoint_shards(Path(model_path)).items():
        with safe_open(str(shard), framework="pt") as file:
            for name in names if names is not None else file.keys():
                tensor_slice = file.get_slice(name)
                header[name] = (tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
    return header


def parameter_named_weights(
    weights: Iterator[tuple[str, CheckpointTensor]],
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Checkpoint tensors under the names our parameters use: compressed-tensors' weight_packed is
    the layer's weight (decoded as it loads), and weight_shape carries nothing a layer needs."""
    for name, tensor in weights:
        renamed = checkpoint_tensor_name(name)
        if renamed is not None:
            yield renamed, tensor


def _name_list(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    more = len(names) - MAX_NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


class DefaultModelLoader(BaseModelLoader):
    def load_weights(self, model: torch.nn.Module, model_path: str) -> None:
        weights = parameter_named_weights(safetensors_weights(model_path))
        cut = layer_cut(model)
        loaded = model.load_weights(weights if cut is None else cut.weights(weights))
        missing = [name for name, _ in model.named_parameters() if name not in loaded]
        if missing:
            model_name = type(model).__name__
            raise WeightLoadError(
                f"{len(missing)} parameter(s) of {model_name} not found in {model_path}: {_name_list(missing)}"
            )
