"""What a run needs, checked before the model loads: a bad model folder, device or KV pool found
after minutes of loading (or as a traceback) costs the user far more than a one-line ConfigError now.

The KV check covers an explicit scheduler_config.num_blocks only: a pool sized from free memory
is known only once the weights are in memory, and the engine checks it then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.comm_manager import DistEnv, launch_problem
from executor.core.config.parallel_layout import ParallelLayout, model_fit_problems, num_experts_of
from executor.core.engine.kv_cache_sizing import check_room_for_one_request
from executor.core.spec_decode.eagle3 import DRAFTER_QUANTIZATION_KEY, DrafterFolder
from executor.core.spec_decode.factory import draft_model_config
from executor.core.spec_decode.mtp import check_mtp_layers
from executor.model_loader.default_loader import INDEX_FILE, checkpoint_shards
from executor.model_loader.default_model import expand_home_vars
from executor.model_loader.quantization_config import QuantizationRequest, quantization_request, read_quantization
from executor.platform.platform import detect_device_type
from executor.types_.errors import WeightLoadError

# JSON files of a model folder that the loaders read when present; config.json must be there.
MODEL_JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE)
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def check_model_folder(model_path: Path, config_cls: Any, with_ckpt: bool) -> Any:
    """Every JSON file parses, the HF config builds, and (with_ckpt) each weight file has a sound header.

    Returns the HF config.
    """
    for name in MODEL_JSON_FILES:
        if name == "config.json" or (model_path / name).exists():
            _read_json_object(model_path / name)
    try:
        hf_config = config_cls.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises many types for a config it cannot use
        raise ConfigError(f"{model_path / 'config.json'}: not a usable model config ({one_line(exc)})") from None
    vocab_size = getattr(hf_config, "vocab_size", None)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"{model_path / 'config.json'}: vocab_size must be a positive integer, got {vocab_size!r}")
    if with_ckpt:
        _check_weight_files(model_path)
    return hf_config


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({one_line(exc)})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _check_weight_files(model_path: Path) -> None:
    index_path = model_path / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{index_path}: 'weight_map' must map tensor names to file names")
    try:
        shards = checkpoint_shards(model_path)
    except WeightLoadError as exc:
        raise ConfigError(str(exc)) from None
    for shard, names in shards.items():
        tensor_names = safetensors_tensor_names(shard)
        missing = sorted(set(names or ()) - tensor_names)
        if missing:
            raise ConfigError(f"{shard}: lacks tensor(s) {', '.join(missing[:5])} that {index_path.name} lists in it")


def safetensors_tensor_names(path: Path) -> set[str]:
    """The tensor names of a safetensors file whose header is sound and whose data is all there.

    Layout: 8 bytes little-endian header length N, N bytes of JSON header, then the tensor data;
    each tensor's data_offsets are relative to the start of the data.
    """

    def corrupt(reason: str) -> ConfigError:
        return ConfigError(f"weight file {path} is corrupt: {reason}; fetch or convert the model again")

    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise corrupt(f"{size} bytes, shorter than a safetensors header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise corrupt(f"its header claims {header_len} bytes but the file has {size}")
        try:
            header = json.loads(file.read(header_len).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise corrupt("its header is not JSON") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    data_size = size - 8 - header_len
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise corrupt(f"tensor {name!r} has no valid data_offsets")
        if not 0 <= offsets[0] <= offsets[1]:
            raise corrupt(f"tensor {name!r} has data_offsets {offsets}")
        data_end = max(data_end, offsets[1])
    if data_end > data_size:
        raise corrupt(f"truncated: its tensors need {data_end} bytes of data, it holds {data_size}")
    return set(header) - {"__metadata__"}


def check_device(config: InferenceConfig) -> str:
    """The device type the run will use; a device that is not there is a ConfigError."""
    try:
        return detect_device_type(config.model_config.device)
    except (RuntimeError, ValueError) as exc:  # NpuUnavailableError is a RuntimeError
        raise ConfigError(f"{one_line(exc)} ({config.source})") from None


def check_kv_pool(config: InferenceConfig, model_max_len: int) -> None:
    """An explicit num_blocks must hold one request of max_model_len beside the null block, block 0
    (the rule of executor/core/engine/kv_cache_sizing.py, for one cache group). A model with several
    cache groups needs that many times more; the engine checks that, and a budget sized from free
    memory, once the model is built."""
    sched = config.scheduler_config
    if sched.num_blocks:
        budget = f"scheduler_config.num_blocks {sched.num_blocks} (block 0 reserved)"
        max_model_len = sched.max_model_len or model_max_len
        check_room_for_one_request(sched.num_blocks, budget, sched.block_size, max_model_len, 1, config.source)


def one_line(exc: BaseException) -> str:
    """An exception as one line, for messages to the user."""
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def check_quantization(config: InferenceConfig, hf_config: Any, model_path: Path) -> None:
    """config.json's quantization_config and model_config.quantization describe schemes that run here
    and do not conflict (the tensors themselves are checked once the layers are built, before any is read)."""
    try:
        read_quantization(hf_config, quantization_request(config.model_config), f"{model_path / 'config.json'}")
    except WeightLoadError as exc:
        raise ConfigError(f"{exc} ({config.source})") from None


def check_speculation(config: InferenceConfig, model_cls: Any, hf_config: Any, model_path: Path) -> None:
    """MTP drafting (model_config.next_n, speculative_config.method mtp) needs MTP layers that the
    model class builds from this config.json, and method draft_model a draft model folder; a model
    without them is refused before it loads."""
    if config.speculation[0] == "mtp":
        check_mtp_layers(model_cls, hf_config, config, str(model_path / "config.json"))
    if config.speculation[0] == "draft_model":
        check_draft_model_folder(config, type(hf_config))
    if config.speculation[0] == "eagle3":
        check_eagle3_drafter_folder(config, hf_config)


def check_eagle3_drafter_folder(config: InferenceConfig, hf_config: Any) -> None:
    """speculative_config.draft_model_path holds an EAGLE-3 drafter for this target, which
    speculative_config.quantization's schemes can quantize (checked before the target loads)."""
    path = str(Path(expand_home_vars(config.speculative_config.draft_model_path)).expanduser())
    try:
        DrafterFolder.read(path, hf_config, config.model_config.model_name, config.speculative_config.quantization)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"speculative_config.draft_model_path in {config.source}: {one_line(exc)}") from None


def check_draft_model_folder(config: InferenceConfig, config_cls: Any) -> Any:
    """speculative_config.draft_model_path holds a model folder as sound as model_path's must be
    (checked before either model loads); returns the draft's HF config."""
    draft_path = Path(draft_model_config(config).model_config.model_path)
    if not (draft_path / "config.json").is_file():
        raise ConfigError(
            f"speculative_config.draft_model_path {str(draft_path)!r} in {config.source} is not a model folder "
            "(no config.json)"
        )
    draft_hf_config = check_model_folder(draft_path, config_cls, config.model_config.with_ckpt)
    # draft_model_config decides the draft's schemes; the message names the key they came from
    key = DRAFTER_QUANTIZATION_KEY if config.speculative_config.quantization else "model_config.quantization"
    request = QuantizationRequest(draft_model_config(config).model_config.quantization, key)
    try:
        read_quantization(draft_hf_config, request, f"{draft_path / 'config.json'}")
    except WeightLoadError as exc:
        raise ConfigError(f"{exc} ({config.source})") from None
    return draft_hf_config


def check_parallel_layout(config: InferenceConfig, hf_config: Any) -> None:
    """parallel_config's sizes against the model (heads, KV heads, experts, vocab, FFN widths), against
    what is built and against the processes started; all problems in one ConfigError, before any
    process group or weight."""
    layout = ParallelLayout.from_config(config.parallel_config)
    problems = [f"{problem} in {config.source}" for problem in model_fit_problems(layout, hf_config)]
    launch = launch_problem(layout.world_size, DistEnv.from_environ())
    if launch is not None:
        problems.append(f"{launch} ({config.source})")
    if layout.world_size > 1:
        where = f"with world_size {layout.world_size} in {config.source}"
        problems += [f"{problem} {where}" for problem in _one_process_only(config)]
        problems += [f"{problem} in {config.source}" for problem in _draft_model_problems(config, layout, hf_config)]
    if problems:
        raise ConfigError.from_problems(problems, config.source)


def _one_process_only(config: InferenceConfig) -> list[str]:
    """Features that do not run on several processes yet: the CPU's npugraph_ex packages
    (AOTInductor) hang in a collective (docs/distributed.md, Graphs across processes)."""
    problems = []
    if config.model_config.exe_mode == "npugraph_ex" and check_device(config) == "cpu":
        problems.append(
            "model_config.exe_mode 'npugraph_ex' on the cpu (AOTInductor packages) hangs in a collective's "
            "wait after a few steps across processes (torch 2.13, gloo); use ge_graph"
        )
    return problems


def _draft_model_problems(config: InferenceConfig, layout: ParallelLayout, hf_config: Any) -> list[str]:
    """Above one process the draft model runs on the target's layout: it must split by it too, and
    its groups may span the replicas only where the target's do (the replicas then step in
    lock-step; otherwise a replica may have stopped while another's draft forward waits for it)."""
    if config.speculation[0] != "draft_model":
        return []
    draft_path = Path(draft_model_config(config).model_config.model_path)
    draft_hf_config = check_draft_model_folder(config, type(hf_config))
    problems = [f"the draft model ({draft_path}): {problem}" for problem in model_fit_problems(layout, draft_hf_config)]
    draft_kinds = layout.lock_step_kinds(has_experts=num_experts_of(draft_hf_config) > 0)
    if draft_kinds and not layout.lock_step_kinds(has_experts=num_experts_of(hf_config) > 0):
        problems.append(
            f"the draft model ({draft_path}) has experts whose groups ({', '.join(draft_kinds)}) span the "
            "data-parallel replicas while the target's do not: not built (the replicas do not step in lock-step)"
        )
    return problems
