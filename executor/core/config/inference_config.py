"""InferenceConfig: a run's YAML, loaded, overridden from the command line and validated.

Validation happens here, before anything heavy: an unknown key, a wrong type, an out-of-range
or refused value is a problem naming the section, the key and the file (and, for an unknown key,
a close name of the same section); every problem of the file is raised in one ConfigError.

A file in cann-recipes' flattened schema (flat_schema.py) is told by its keys, checked against its
own tables and translated into the sectioned mapping first; a file mixing the two is refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from executor.core.config.errors import ConfigError
from executor.core.config.flat_schema import FLAT_SECTIONS, TOP_LEVEL
from executor.core.config.parallel_layout import ParallelLayout
from executor.core.config.sections import (
    NESTED,
    NOT_APPLICABLE,
    REFUSED,
    SECTIONS,
    DataConfig,
    DisaggConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from executor.core.config.yaml_loader import load_yaml_mapping
from executor.types_.structured_output import parse_structured_output

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_TOKENS = 8192  # per request slot, for max_prefill_tokens 0 without input_truncated_len
HINT_CUTOFF = 0.8  # difflib ratio a name must reach to be offered as "did you mean"
MIN_MODEL_LEN = 2  # the shortest a request can be: one prompt token and one generated token


@dataclass(slots=True)
class InferenceConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disagg_config: DisaggConfig = field(default_factory=DisaggConfig)
    source: str = "<defaults>"  # the YAML file this came from, for error messages and output names
    # `section.key` of every key the file set; a flattened file's keys with no sectioned one under their own name
    explicit_keys: frozenset[str] = frozenset()

    @property
    def prefill_token_budget(self) -> int:
        """scheduler_config.max_prefill_tokens, or when 0 cann-recipes' derived budget: every
        request's truncated prompt at once (input_truncated_len x batch_size, or x the context-parallel
        cap max_prefill_requests where it is smaller); 8192 per request slot without truncation."""
        sched = self.scheduler_config
        if sched.max_prefill_tokens:
            return sched.max_prefill_tokens
        slots = min(sched.batch_size, self.max_prefill_requests or sched.batch_size)
        return (self.data_config.input_truncated_len or DEFAULT_PREFILL_TOKENS) * slots

    @property
    def max_prefill_requests(self) -> int:
        """The most requests one prefill step holds: scheduler_config.cp_mini_batch under context
        parallel when it is positive (cann-recipes' meaning), else 0 (no cap beyond batch_size)."""
        cap = self.scheduler_config.cp_mini_batch
        return cap if self.parallel_config.cp_size > 1 and cap > 0 else 0

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @property
    def speculation(self) -> tuple[str, int]:
        """(method, draft tokens per step): speculative_config, or cann-recipes' model_config.next_n
        (which means method mtp); ("", 0) when speculative decoding is off."""
        spec = self.speculative_config
        if self.model_config.next_n > 0:
            return "mtp", self.model_config.next_n
        return (spec.method, spec.num_speculative_tokens) if spec.method else ("", 0)


def load_config(path: str | Path, overrides: list[str] | None = None) -> InferenceConfig:
    """Read a YAML file, apply `section.key=value` overrides, validate, and build the config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return build_config(load_yaml_mapping(path), source=str(path), overrides=overrides or [])


def apply_override(raw: dict[str, Any], override: str, source: str) -> None:
    """Apply one `--set section.key=value`; the value is parsed as YAML (so 8, true, [1, 2] work)."""
    dotted, sep, value_text = override.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set expects section.key=value, got {override!r}")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {override!r}: value is not valid YAML ({' '.join(str(exc).split())})") from None
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"--set {override!r}: section {section!r} in {source} is not a mapping")
    target[key] = value


def build_config(raw: dict[str, Any], source: str = "<dict>", overrides: list[str] | None = None) -> InferenceConfig:
    """Validate every key of every section and build the config; all problems found are raised
    together as one ConfigError (an invalid value is replaced by its default so that the checks
    after it still run). A flattened file is translated first; overrides use the sectioned names."""
    problems: list[str] = []
    file = _in_sectioned_schema(raw, source, problems)
    for override in overrides or []:
        apply_override(file.raw, override, source)
    raw = file.raw
    for section in raw:
        if section not in SECTIONS:
            hint = _did_you_mean(section, SECTIONS, "; sections: " + ", ".join(SECTIONS))
            problems.append(f"unknown section {section!r} in {source}{hint}")
    built = {
        name: _build_section(name, section_cls, raw.get(name) or {}, source, problems)
        for name, section_cls in SECTIONS.items()
    }
    explicit = frozenset(_explicit_keys(raw)) | file.flat_only_keys
    config = InferenceConfig(**built, source=source, explicit_keys=explicit)
    _check_cross_rules(config, problems)
    if problems:
        raise ConfigError.from_problems(problems, source)
    return config


@dataclass(slots=True)
class _SectionedFile:
    """A file's mapping in the sectioned schema, whichever schema it was written in."""

    raw: dict[str, Any]
    flat_only_keys: frozenset[str] = frozenset()  # its flattened keys that no sectioned key stands for


def _in_sectioned_schema(raw: dict[str, Any], source: str, problems: list[str]) -> _SectionedFile:
    """The file itself when sectioned; a flattened file's keys validated against flat_schema.py's tables
    and written at the sectioned places they mean. Told apart by the keys only one schema has."""
    flat, sectioned = _schema_marks(raw)
    if flat and sectioned and set(flat) <= KEPT_AT_TOP.keys():
        return _SectionedFile(_fold_kept_keys(raw, source, problems))
    if flat and sectioned:
        raise ConfigError(
            f"{source} mixes cann-recipes' two schemas: {', '.join(flat)} (flattened) with {', '.join(sectioned)} "
            "(sectioned); write it in one of them (docs/configuration.md)"
        )
    if not flat:
        return _SectionedFile(raw)
    translated: dict[str, Any] = {}
    flat_only: set[str] = set()
    written_as: dict[str, str] = {}  # sectioned key -> the flattened key that set it
    for prefix, keys_cls in FLAT_SECTIONS.items():
        values = {k: v for k, v in raw.items() if k not in FLAT_SECTIONS} if prefix == TOP_LEVEL else raw.get(prefix)
        if not isinstance(values, dict):
            if values is not None:
                problems.append(f"section {prefix} in {source} must be a mapping, got {type(values).__name__}")
            continue
        metadata = {f.name: f.metadata for f in dataclasses.fields(keys_cls)}
        for key, value in _valid_values(prefix, keys_cls, values, source, problems).items():
            flat_key = _dotted(prefix, key)
            target = metadata[key].get("maps_to")
            if target is None:
                flat_only.add(flat_key)
            else:
                value = metadata[key]["values"].get(value, value) if "values" in metadata[key] else value
                _write_at(translated, target, value, flat_key, written_as, source, problems)
    return _SectionedFile(translated, frozenset(flat_only))


# Top-level keys a sectioned cann-recipes file may keep beside its sections "for backward
# compatibility" (its *_pd/prefill.yaml and decode.yaml do), and the sectioned key each repeats.
KEPT_AT_TOP = {"model_name": "model_config.model_name", "world_size": "parallel_config.world_size"}


def _fold_kept_keys(raw: dict[str, Any], source: str, problems: list[str]) -> dict[str, Any]:
    """The sectioned file without its kept top-level keys: each must equal the sectioned key it
    repeats, or stands for it where the section leaves it out."""
    folded = {key: value for key, value in raw.items() if key not in KEPT_AT_TOP}
    for key, target in KEPT_AT_TOP.items():
        if key not in raw:
            continue
        section, inner = target.split(".")
        values = folded.setdefault(section, {})
        if not isinstance(values, dict):
            continue  # the section's own check says what is wrong with it
        if inner not in values:
            folded[section] = values | {inner: raw[key]}
        elif values[inner] != raw[key]:
            problems.append(
                f"{key} {raw[key]!r} at the top of {source} (kept for backward compatibility) differs from "
                f"{target} {values[inner]!r}; make them agree or drop the top-level one"
            )
    return folded


def _schema_marks(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(keys only the flattened schema has, keys only the sectioned one has) in the file."""
    flat = [key for key in raw if key in FLAT_SECTIONS[TOP_LEVEL].__dataclass_fields__]
    sectioned = [key for key in raw if key in SECTIONS and key not in FLAT_SECTIONS]
    for section in (name for name in FLAT_SECTIONS if name in SECTIONS):
        values = raw.get(section)
        if isinstance(values, dict):
            flat_keys, sectioned_keys = (
                FLAT_SECTIONS[section].__dataclass_fields__,
                SECTIONS[section].__dataclass_fields__,
            )
            flat += [f"{section}.{key}" for key in values if key in flat_keys and key not in sectioned_keys]
            sectioned += [f"{section}.{key}" for key in values if key in sectioned_keys and key not in flat_keys]
    return flat, sectioned


def _write_at(
    raw: dict[str, Any],
    target: str,
    value: Any,
    flat_key: str,
    written_as: dict[str, str],
    source: str,
    problems: list[str],
) -> None:
    """Set the sectioned key `target` (a NESTED mapping key by key); two flattened keys for one is a problem."""
    if target in NESTED:
        for inner, inner_value in value.items():
            _write_at(raw, f"{target}.{inner}", inner_value, f"{flat_key}.{inner}", written_as, source, problems)
        return
    if target in written_as:
        problems.append(f"{written_as[target]} and {flat_key} in {source} both set {target}; set one of them")
        return
    written_as[target] = flat_key
    *parents, key = target.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[key] = value


def _dotted(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _explicit_keys(raw: dict[str, Any]) -> Iterator[str]:
    """`section.key` (and `section.key.inner` for the NESTED mappings) of every key a file sets."""
    for name, values in raw.items():
        if name in SECTIONS and isinstance(values, dict):
            for key, value in values.items():
                yield f"{name}.{key}"
                if f"{name}.{key}" in NESTED and isinstance(value, dict):
                    yield from (f"{name}.{key}.{inner}" for inner in value)


def _build_section(name: str, section_cls: type, values: Any, source: str, problems: list[str]) -> Any:
    if not isinstance(values, dict):
        problems.append(f"section {name} in {source} must be a mapping, got {type(values).__name__}")
        return section_cls()
    return section_cls(**_valid_values(name, section_cls, values, source, problems))


def _valid_values(prefix: str, keys_cls: type, values: dict, source: str, problems: list[str]) -> dict[str, Any]:
    """The entries of `values` that pass their field's type, rule and outcome; a problem for each other."""
    fields = {f.name: f for f in dataclasses.fields(keys_cls)}
    hints = typing.get_type_hints(keys_cls)
    valid: dict[str, Any] = {}
    for key, value in values.items():
        where = f"{_dotted(prefix, key)} in {source}"
        if key not in fields:
            hint = _did_you_mean(str(key), fields, f"; docs/configuration.md lists the keys of {prefix or 'the file'}")
            shown = key if isinstance(key, str) and key.isprintable() else repr(key)  # one line, whatever the key
            problems.append(f"unknown key {_dotted(prefix, shown)} in {source}{hint}")
            continue
        try:
            _check_type(value, hints[key], where)
            _check_rule(value, fields[key].metadata, where)
            _check_outcome(value, fields[key].metadata, where)
            nested = NESTED.get(f"{prefix}.{key}")
            if nested is not None:
                count = len(problems)
                _valid_values(f"{prefix}.{key}", nested, value, source, problems)
                if len(problems) > count:
                    continue
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        valid[key] = value
    return valid


def _check_outcome(value: Any, metadata: typing.Mapping[str, Any], where: str) -> None:
    if metadata["outcome"] == REFUSED and value not in metadata["runs_with"]:
        runs_with = ", ".join(repr(v) for v in metadata["runs_with"])
        raise ConfigError(f"{where} is refused at {value!r}: {metadata['reason']}; it runs with {runs_with}")


def _check_type(value: Any, expected: Any, where: str) -> None:
    origin = typing.get_origin(expected)
    if origin is list:
        (item_type,) = typing.get_args(expected)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        for item in value:
            _check_type(item, item_type, where)
        return
    if origin in (typing.Union, types.UnionType):
        if not any(_matches(value, option) for option in typing.get_args(expected)):
            raise ConfigError(f"{where} must be {expected}, got {value!r}")
        return
    if expected is dict and isinstance(value, dict) and not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where} must be a mapping with string keys, got {value!r}")
    if not _matches(value, expected):
        raise ConfigError(f"{where} must be {_type_name(expected)}, got {type(value).__name__} {value!r}")


def _matches(value: Any, expected: Any) -> bool:
    if expected is type(None):
        return value is None
    if expected is float:  # an int is a fine float; a bool is not a number here
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _type_name(expected: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(
        expected, str(expected)
    )


def _check_rule(value: Any, metadata: typing.Mapping[str, Any], where: str) -> None:
    if value is None:  # an optional key left off: ranges apply to values only
        return
    if isinstance(value, list):  # a list's rule holds for each of its items
        for item in value:
            _check_rule(item, metadata, where)
        return
    if isinstance(value, float) and value != value:
        raise ConfigError(f"{where} must be a number, got .nan")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where} must be one of {list(choices)}, got {value!r}{_did_you_mean(str(value), choices)}")
    if "min" in metadata and value < metadata["min"]:
        raise ConfigError(f"{where} must be >= {metadata['min']}, got {value!r}")
    if "above" in metadata and value <= metadata["above"]:
        raise ConfigError(f"{where} must be > {metadata['above']}, got {value!r}")
    if "max" in metadata and value > metadata["max"]:
        raise ConfigError(f"{where} must be <= {metadata['max']}, got {value!r}")


def _check_cross_rules(config: InferenceConfig, problems: list[str]) -> None:
    """Rules that involve more than one key."""
    sched = config.scheduler_config
    if 0 < sched.max_model_len < MIN_MODEL_LEN:
        problems.append(
            f"scheduler_config.max_model_len in {config.source}: must be 0 (the model's own limit) or at least "
            f"{MIN_MODEL_LEN} (one prompt token and one generated token), got {sched.max_model_len}"
        )
    for bucket in sched.graph_buckets:
        if not 1 <= bucket <= sched.batch_size:
            problems.append(
                f"scheduler_config.graph_buckets in {config.source}: every bucket must be in 1..batch_size "
                f"({sched.batch_size}), got {bucket}"
            )
    try:
        _check_speculation(config)
    except ConfigError as exc:
        problems.append(str(exc))
    try:
        parse_structured_output(dataclasses.asdict(config.data_config))
    except ValueError as exc:
        problems.append(f"data_config in {config.source}: {exc}")
    problems.extend(f"{problem} in {config.source}" for problem in parallel_size_problems(config))
    problems.extend(f"{problem} in {config.source}" for problem in context_parallel_problems(config))


def context_parallel_problems(config: InferenceConfig) -> list[str]:
    """cann-recipes' rules for context parallel: cp_size is 1 or world_size, with attn_tp_size 1
    (every rank takes a share of each step's tokens, none splits the heads)."""
    parallel = config.parallel_config
    if parallel.cp_size == 1:
        return []
    problems = []
    if parallel.cp_size != parallel.world_size:
        problems.append(
            f"parallel_config.cp_size {parallel.cp_size} must be 1 or world_size ({parallel.world_size}): context "
            "parallel spans every rank"
        )
    if parallel.attn_tp_size != 1:
        problems.append(
            f"parallel_config.attn_tp_size {parallel.attn_tp_size} must be 1 with cp_size {parallel.cp_size}: "
            "context parallel splits the tokens, not the heads"
        )
    return problems


def parallel_size_problems(config: InferenceConfig) -> list[str]:
    """Parallel sizes that do not tile world_size (whether they fit the model is checked in preflight)."""
    return ParallelLayout.from_config(config.parallel_config).size_problems()


def _check_speculation(config: InferenceConfig) -> None:
    spec, next_n, where = config.speculative_config, config.model_config.next_n, config.source
    if next_n > 0 and spec.method not in ("", "mtp"):
        raise ConfigError(
            f"model_config.next_n {next_n} means speculative_config.method mtp, but {where} sets method {spec.method!r}"
        )
    if next_n > 0 and spec.num_speculative_tokens not in (0, next_n):
        raise ConfigError(
            f"model_config.next_n {next_n} and speculative_config.num_speculative_tokens "
            f"{spec.num_speculative_tokens} in {where} disagree; set one of them"
        )
    if spec.method and next_n == 0 and spec.num_speculative_tokens < 1:
        raise ConfigError(
            f"speculative_config.num_speculative_tokens in {where} must be >= 1 with method {spec.method!r}"
        )
    if spec.quantization and config.speculation[0] not in ("draft_model", "eagle3"):
        raise ConfigError(
            f"speculative_config.quantization in {where} quantizes a drafter's own weights (methods eagle3 and "
            f"draft_model); method {config.speculation[0] or 'off'!r} has none (MTP layers are the model's: "
            "model_config.quantization quantizes them)"
        )
    if spec.method in ("draft_model", "eagle3") and not spec.draft_model_path:
        raise ConfigError(f"speculative_config.draft_model_path in {where} is required with method {spec.method}")
    if spec.method == "eagle3" and config.model_config.exe_mode == "npugraph_ex":
        raise ConfigError(
            f"speculative_config.method eagle3 in {where} runs in eager and ge_graph: its hidden states come from "
            "hooks on the target's layers, which an ahead-of-time compiled graph (npugraph_ex) does not run"
        )
    if spec.method == "eagle3" and config.parallel_config.cp_size > 1:
        raise ConfigError(
            f"speculative_config.method eagle3 in {where} does not run with parallel_config.cp_size "
            f"{config.parallel_config.cp_size}: a prefill split over the ranks leaves each rank's layer hooks only "
            "its share of the hidden states the drafter reads (MTP gathers them; EAGLE-3 does not yet)"
        )
    if spec.prompt_lookup and config.speculation[0] not in ("mtp", "eagle3"):
        raise ConfigError(
            f"speculative_config.prompt_lookup in {where} puts prompt lookup in front of a drafter of methods mtp "
            f"and eagle3; method {config.speculation[0] or 'off'!r} has none (method ngram is prompt lookup alone)"
        )
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise ConfigError(
            f"speculative_config.prompt_lookup_min {spec.prompt_lookup_min} in {where} exceeds "
            f"prompt_lookup_max {spec.prompt_lookup_max}"
        )


def not_applicable_keys(config: InferenceConfig, device_type: str) -> list[tuple[str, str]]:
    """(key, why) for every key the file sets that does nothing here: logged once at start-up."""
    notes = []
    for key in sorted(config.explicit_keys):
        metadata = key_metadata(key)
        if metadata is None:
            continue
        if metadata["outcome"] == NOT_APPLICABLE:
            notes.append((key, metadata["reason"]))
        elif metadata.get("npu_only") and device_type != "npu":
            notes.append((key, "only applies on NPU"))
    return notes


def key_metadata(dotted: str) -> typing.Mapping[str, Any] | None:
    """The field metadata of `section.key` or `section.key.inner` (NESTED), else of a flattened key
    (FLAT_SECTIONS); None for another name."""
    prefix, _, key = dotted.rpartition(".")
    for tables in (SECTIONS, NESTED, FLAT_SECTIONS):
        keys_cls = tables.get(prefix)
        found = keys_cls and keys_cls.__dataclass_fields__.get(key)
        if found:
            return found.metadata
    return None


def check_device_rules(config: InferenceConfig, device_type: str) -> None:
    """Rules that depend on the platform the run landed on."""
    block_size = config.scheduler_config.block_size
    if device_type == "npu" and block_size % 128:
        raise ConfigError(
            f"scheduler_config.block_size in {config.source} must be a multiple of 128 on NPU "
            f"(npu_fused_infer_attention_score prefill with paged KV), got {block_size}"
        )


def _did_you_mean(word: str, candidates: typing.Iterable[str], otherwise: str = "") -> str:
    """A hint from the names given (one section's) only when one is close; else `otherwise`."""
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=HINT_CUTOFF)
    return f"; did you mean {close[0]!r}?" if close else otherwise
