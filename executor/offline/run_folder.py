"""A run folder belongs to one run: running into it again continues that run and never overwrites it.

Every outputs.jsonl line carries a request hash: the dataset line's content (without its id) and
the settings that change outputs. A rerun skips the requests already there with the same id and
hash, runs the rest, and refuses (before any model loads) when the settings or a prompt changed,
since the folder would then mix two different runs. Only reading happens here; results.py writes.

With several data-parallel replicas, each replica's leader writes its finished requests to
outputs_dp<d>.jsonl as they finish; rank 0 appends them to outputs.jsonl (in prompt order) once
every replica has stopped, then removes those files. A run stopped before that (a crash, a kill)
leaves them behind: a rerun counts their lines as done and merges them at its end.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from executor.core.config import ConfigError, InferenceConfig, build_config
from executor.offline.dataset import PromptRecord
from executor.offline.durable_io import CorruptLineError, JsonlContents, read_jsonl

OUTPUTS_FILE = "outputs.jsonl"
STEPS_FILE = "steps.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
REPLICA_OUTPUTS_PATTERN = re.compile(r"outputs_dp(\d+)\.jsonl")
REPLICA_STEPS_PATTERN = re.compile(r"steps_dp(\d+)\.jsonl")
MAX_CHANGES_SHOWN = 5  # changed settings named in a refusal
_ABSENT = object()

# Keys that change where results go, what is recorded or how fast the run goes, but not what a
# request generates; a resumed run may change them. Every other key changes outputs.
OUTPUT_NEUTRAL_KEYS = frozenset(
    {
        "model_config.output_path",
        "model_config.enable_profiler",
        "model_config.profile_prefill_steps",
        "model_config.profile_decode_steps",
        "model_config.step_breakdown",
        "model_config.enable_cache_compile",
        "model_config.enable_static_kernel",
        "model_config.enable_dynamic_graph",
        "model_config.graph_cpp_wrapper",
        "data_config.dataset",  # which prompts run is matched request by request instead
        "data_config.dataset_path",
        "data_config.num_prompts",
        "scheduler_config.batch_size",
        "scheduler_config.max_prefill_tokens",
        "scheduler_config.mem_fraction_static",
        "scheduler_config.block_size",
        "scheduler_config.num_blocks",
    }
)


def output_settings(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`section.key -> value` for every key that changes outputs."""
    return {
        f"{section}.{key}": value
        for section, values in sections.items()
        for key, value in values.items()
        if f"{section}.{key}" not in OUTPUT_NEUTRAL_KEYS
    }


def replica_outputs_file(dp_rank: int) -> str:
    """Where data-parallel replica `dp_rank` writes its finished requests until rank 0 merges them."""
    return f"outputs_dp{dp_rank}.jsonl"


def replica_steps_file(dp_rank: int) -> str:
    """Replica `dp_rank`'s step log: replica 0's is steps.jsonl (rank 0 writes it), the others' apart,
    since step numbers and times of different replicas do not line up."""
    return STEPS_FILE if dp_rank == 0 else f"steps_dp{dp_rank}.jsonl"


def replica_step_text_file(dp_rank: int) -> str:
    """Replica `dp_rank`'s step lines as text (ours and cann-recipes' worded ones: offline_inference.py's StepLog)."""
    return Path(replica_steps_file(dp_rank)).with_suffix(".log").name


@dataclass(frozen=True, slots=True)
class StepFiles:
    """One replica's step files in its run folder, and the part of the run its lines belong to."""

    text: Path  # steps.log
    jsonl: Path  # steps.jsonl
    part: int


def replica_files(output_dir: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The folder's files whose names match `pattern` (outputs_dp<d>.jsonl or steps_dp<d>.jsonl), by DP rank."""
    if not output_dir.is_dir():
        return []
    numbered = [(pattern.fullmatch(path.name), path) for path in output_dir.iterdir()]
    return [path for _, path in sorted((int(m.group(1)), p) for m, p in numbered if m) if path.is_file()]


def unmerged_replica_lines(
    merged: Iterable[dict[str, Any]], replica_lines: Iterable[dict[str, Any]], prompt_order: Sequence[str]
) -> list[dict[str, Any]]:
    """The per-replica files' lines that outputs.jsonl (`merged`) does not hold yet, each id once
    (a merge cut short by a crash leaves a line in both), in prompt order; ids that are not among
    this run's prompts (a shorter dataset) follow, in the order found."""
    seen = {line["id"] for line in merged}
    new: list[dict[str, Any]] = []
    for line in replica_lines:
        if line["id"] not in seen:
            seen.add(line["id"])
            new.append(line)
    position = {request_id: index for index, request_id in enumerate(prompt_order)}
    return sorted(new, key=lambda line: position.get(line["id"], len(position)))


def settings_hash(config: InferenceConfig) -> str:
    canonical = json.dumps(output_settings(config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def request_hash(record: PromptRecord, settings: str) -> str:
    """What must match for an earlier outputs line to stand for this record in this run."""
    return hashlib.sha256(f"{settings}:{record.content_hash}".encode()).hexdigest()[:16]


@dataclass(slots=True)
class RunPlan:
    """What a run into `output_dir` does: which requests are done and which remain."""

    output_dir: Path
    request_hashes: dict[str, str]  # record id -> request hash, for every record of this run
    pending: list[PromptRecord]  # records with no line in outputs.jsonl yet, in dataset order
    outputs: JsonlContents  # what outputs.jsonl holds (lines of earlier parts, a torn tail)
    steps: JsonlContents
    resumed: bool = False  # the folder holds an earlier part of this run
    earlier_summary: dict[str, Any] = field(default_factory=dict)
    # outputs_dp<d>.jsonl and steps_dp<d>.jsonl left by earlier parts (file name -> contents)
    replica_outputs: dict[str, JsonlContents] = field(default_factory=dict)
    replica_steps: dict[str, JsonlContents] = field(default_factory=dict)

    @property
    def part(self) -> int:
        """This part's number (1 for a new run): every rank computes it alike before rank 0 writes."""
        return len(self.earlier_summary.get("parts", [])) + 1

    def replica_lines(self) -> list[dict[str, Any]]:
        """Every line of the earlier parts' per-replica output files, in DP-rank order."""
        return [line for contents in self.replica_outputs.values() for line in contents.lines]


def plan_run(output_dir: Path, config: InferenceConfig, records: list[PromptRecord]) -> RunPlan:
    """Check the folder can be written and, if it holds a run, that this one continues it; read only."""
    check_output_dir(output_dir)
    settings = settings_hash(config)
    hashes = {record.id: request_hash(record, settings) for record in records}
    if not (output_dir / CONFIG_FILE).is_file():
        leftovers = [name for name in (OUTPUTS_FILE, SUMMARY_FILE) if (output_dir / name).exists()]
        leftovers += [path.name for path in replica_files(output_dir, REPLICA_OUTPUTS_PATTERN)]
        if leftovers:
            raise ConfigError(
                f"output folder {output_dir} holds {', '.join(leftovers)} but no {CONFIG_FILE}, so it cannot be "
                "continued; choose another model_config.output_path"
            )
        empty = JsonlContents([], 0, b"")
        return RunPlan(output_dir, hashes, list(records), empty, empty)
    _check_same_settings(output_dir, config)
    outputs = _read(output_dir / OUTPUTS_FILE)
    replica_outputs = {path.name: _read(path) for path in replica_files(output_dir, REPLICA_OUTPUTS_PATTERN)}
    done = _match_earlier_lines(output_dir / OUTPUTS_FILE, outputs, hashes)
    for name, contents in replica_outputs.items():
        done |= _match_earlier_lines(output_dir / name, contents, hashes)
    return RunPlan(
        output_dir,
        hashes,
        [record for record in records if record.id not in done],
        outputs,
        _read(output_dir / STEPS_FILE),
        resumed=True,
        earlier_summary=_read_summary(output_dir / SUMMARY_FILE),
        replica_outputs=replica_outputs,
        replica_steps={path.name: _read(path) for path in replica_files(output_dir, REPLICA_STEPS_PATTERN)},
    )


def check_output_dir(output_dir: Path) -> None:
    """The folder exists or can be created, and can be written in; leaves nothing behind.

    It writes only a probe folder of its own in the nearest folder that exists: every rank of a torchrun
    job checks the same output_path at once, and one rank removing a folder it created while checking
    broke another rank's check.
    """
    nearest = next(p for p in (output_dir, *output_dir.parents) if p.exists())
    try:
        if not nearest.is_dir():
            where = "it is" if nearest == output_dir else f"{nearest} is"
            raise NotADirectoryError(20, f"{where} a file, not a folder")
        with tempfile.TemporaryDirectory(prefix=".write-test-", dir=nearest):
            pass
    except OSError as exc:
        raise ConfigError(
            f"model_config.output_path {str(output_dir)!r} cannot be used: {exc.strerror or exc}"
        ) from None


def read_output_settings(output_dir: Path) -> dict[str, Any]:
    """The settings that change outputs, from a run folder's config.yaml (OSError, UnicodeDecodeError,
    yaml.YAMLError or AttributeError when it cannot be read)."""
    earlier = yaml.safe_load((output_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    return output_settings({k: v for k, v in earlier.items() if isinstance(v, dict)})


def changed_settings(
    earlier: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """`key was X, now Y` for each setting that differs between two runs, by key. With `defaults`, a
    key the earlier run's config lacks (a harness from before the key) that now holds its default is
    no change: the earlier run behaved as the default does."""
    defaults = defaults or {}
    return [
        f"{key} was {_shown(earlier, key)}, now {_shown(current, key)}"
        for key in sorted(set(earlier) | set(current))
        if earlier.get(key, _ABSENT) != current.get(key, _ABSENT)
        and not (key not in earlier and key in defaults and current.get(key, _ABSENT) == defaults[key])
    ]


def prompt_token_ids_hash(token_ids: Sequence[int]) -> str:
    """What outputs.jsonl keeps of a request's prompt token ids: enough to tell two prompts apart."""
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


def _check_same_settings(output_dir: Path, config: InferenceConfig) -> None:
    try:
        earlier_settings = read_output_settings(output_dir)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as exc:
        raise ConfigError(
            f"{output_dir / CONFIG_FILE} cannot be read ({type(exc).__name__}); choose another model_config.output_path"
        ) from None
    defaults = output_settings(build_config({}).to_dict())
    changed = changed_settings(earlier_settings, output_settings(config.to_dict()), defaults)
    if changed:
        more = f"; and {len(changed) - MAX_CHANGES_SHOWN} more" if len(changed) > MAX_CHANGES_SHOWN else ""
        raise ConfigError(
            f"output folder {output_dir} holds a run made with other settings that change outputs "
            f"({'; '.join(changed[:MAX_CHANGES_SHOWN])}{more}); restore them to continue that run, "
            "or choose another model_config.output_path"
        )


def _shown(settings: dict[str, Any], key: str) -> str:
    return repr(settings[key]) if key in settings else "not set"


def _match_earlier_lines(path: Path, outputs: JsonlContents, hashes: dict[str, str]) -> set[str]:
    """Ids already served; a line whose hash differs from this run's record is a refusal."""
    done: set[str] = set()
    for line_no, line in enumerate(outputs.lines, start=1):
        request_id, earlier_hash = line.get("id"), line.get("request_hash")
        where = f"{path}:{line_no}"
        if not isinstance(request_id, str) or not isinstance(earlier_hash, str):
            raise ConfigError(
                f"{where} has no id or request_hash (an older or edited file); choose another output_path"
            )
        if request_id in hashes and hashes[request_id] != earlier_hash:
            raise ConfigError(
                f"{where}: request {request_id!r} was made from a different dataset line (its prompt or its own "
                "settings changed); restore it to continue that run, or choose another model_config.output_path"
            )
        done.add(request_id)
    return done


def _read(path: Path) -> JsonlContents:
    try:
        return read_jsonl(path)
    except (OSError, CorruptLineError) as exc:
        raise ConfigError(f"cannot continue the run in {path.parent}: {exc}") from None


def _read_summary(path: Path) -> dict[str, Any]:
    """The earlier summary.json; written atomically, so it is whole or absent (or edited: then ignored)."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}
