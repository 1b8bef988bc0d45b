"""Where a run's results go: outputs.jsonl (one line per request, written as it finishes),
summary.json and the resolved config.yaml, in one run folder, and which step files the run's
StepLog appends to (executor/offline/offline_inference.py). With several data-parallel replicas each
replica's leader writes its own outputs_dp<d>.jsonl and step files as it serves (ReplicaWriter),
and rank 0 merges the outputs into outputs.jsonl at the end."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from executor.core.config import InferenceConfig
from executor.core.config.model_registry import model_dir
from executor.offline.dataset import PromptRecord
from executor.offline.durable_io import (
    CorruptLineError,
    JsonlContents,
    LineAppender,
    atomic_write_text,
    drop_torn_tail,
    read_jsonl,
    remove_durably,
)
from executor.offline.run_folder import (
    CONFIG_FILE,
    OUTPUTS_FILE,
    REPLICA_OUTPUTS_PATTERN,
    REPLICA_STEPS_PATTERN,
    STEPS_FILE,
    SUMMARY_FILE,
    RunPlan,
    StepFiles,
    prompt_token_ids_hash,
    replica_files,
    replica_outputs_file,
    replica_step_text_file,
    replica_steps_file,
    unmerged_replica_lines,
)
from executor.offline.run_summary import run_summary
from executor.types_ import FinishReason, Request, SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


def default_output_dir(config: InferenceConfig, now: datetime | None = None) -> Path:
    """models/<m>/res/<timestamp>_<yaml-stem>/ unless model_config.output_path says otherwise."""
    if config.model_config.output_path:
        return Path(config.model_config.output_path).expanduser()
    stamp = (now or datetime.now()).strftime("%Y%m%d_%H%M%S")
    return model_dir(config.model_config.model_name) / "res" / f"{stamp}_{Path(config.source).stem}"


def request_result(request: Request, output_text: str) -> dict[str, Any]:
    return {
        "id": request.request_id,
        "prompt": request.prompt,
        "output_text": output_text,
        "output_token_ids": request.output_token_ids,
        "prompt_tokens": request.num_prompt_tokens,
        "prompt_token_ids_hash": prompt_token_ids_hash(request.prompt_token_ids),
        "finish_reason": request.finish_reason.value if request.finish_reason else None,
        "error": request.error,
        "logprobs": _logprobs_result(request),
        "prompt_logprobs": _prompt_logprobs_result(request),
    } | ({"grammar_compile_ms": request.grammar_compile_ms} if request.grammar_compile_ms is not None else {})


def _logprobs_result(request: Request) -> list[dict[str, Any]] | None:
    """Per output token: its logprob and the top ones as [token id, logprob] pairs (docs/sampling.md);
    None when the request asked for none. A step that samples several rows of a request may
    sample past a stop token, whose tokens are dropped: their logprobs are cut here alike."""
    if request.sampling_params.logprobs is None:
        return None
    return [_logprobs_entry(entry) for entry in request.output_logprobs[: len(request.output_token_ids)]]


def _prompt_logprobs_result(request: Request) -> list[dict[str, Any] | None] | None:
    """Per prompt token, as vLLM's prompt_logprobs: None for the first (nothing precedes it), then
    each token's logprob under the positions before it, in the logprobs entries' format; None when
    the request asked for none, empty when it failed before its prompt ran."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    if request.finish_reason is FinishReason.ERROR:
        return []
    return [None, *(_logprobs_entry(entry) for entry in request.prompt_logprobs)]


def _logprobs_entry(entry: TokenLogprobs) -> dict[str, Any]:
    return {
        "token_id": entry.token_id,
        "logprob": entry.logprob,
        "top": [list(pair) for pair in zip(entry.top_token_ids, entry.top_logprobs, strict=True)],
    }


def failed_record_result(record: PromptRecord) -> dict[str, Any]:
    """The outputs line of a dataset record that cannot be served (its error says why)."""
    assert record.error is not None
    return request_result(Request.failed(record.id, None, SamplingParams(), record.error, now_s=0.0), "")


class ResultWriter:
    """Writes the run folder that `plan` describes, continuing what earlier parts left there.

    outputs.jsonl lines are written whole and fsynced as each request finishes; config.yaml and
    summary.json are replaced atomically. summary.json says "running" until finish() is called, so
    a folder whose summary still says so after its process is gone was killed. Lines that
    data-parallel replicas wrote to outputs_dp<d>.jsonl count as done (in summary.json too) and
    are appended to outputs.jsonl by merge_replica_outputs().
    """

    def __init__(self, plan: RunPlan, config: InferenceConfig) -> None:
        self.output_dir = plan.output_dir
        self._request_hashes = plan.request_hashes
        self.output_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"source": config.source, **config.to_dict()}
        atomic_write_text(self.output_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
        self._outputs = continue_appending(self.output_dir / OUTPUTS_FILE, plan.outputs, sync=True)
        drop_torn_line(self.output_dir / STEPS_FILE, plan.steps)
        self.output_lines = list(plan.outputs.lines)  # what outputs.jsonl holds
        earlier_parts = plan.earlier_summary.get("parts", [])
        self._parts = [
            part | {"status": "killed"} if part.get("status") == "running" else part for part in earlier_parts
        ]
        self._part: dict[str, Any] = {"part": plan.part, "status": "running", "started_at": _now()}
        self._parts.append(self._part)
        self._lines_this_part: list[dict[str, Any]] = []
        self.finish("running")

    @property
    def profile_dir(self) -> Path:
        return self.output_dir / "prof"

    @property
    def step_files(self) -> StepFiles:
        return StepFiles(self.output_dir / replica_step_text_file(0), self.output_dir / STEPS_FILE, self._part["part"])

    def write_request(self, result: dict[str, Any]) -> None:
        line = result | {"request_hash": self._request_hashes[result["id"]]}
        self._outputs.append(line)
        self.output_lines.append(line)
        self._lines_this_part.append(line)

    def add_replica_results(self, results: list[dict[str, Any]]) -> None:
        """This part's requests that the data-parallel replicas served (their leaders wrote the
        lines): they count in this part's summary."""
        self._lines_this_part.extend(results)

    def merge_replica_outputs(self) -> None:
        """Append the lines of every outputs_dp<d>.jsonl that outputs.jsonl lacks, in prompt order,
        synced, then remove those files. Only when no replica writes them any more: at the end of a
        data-parallel part (after the gather), or at the complete end of any part."""
        paths = replica_files(self.output_dir, REPLICA_OUTPUTS_PATTERN)
        if not paths:
            return
        replica_lines = [line for path in paths for line in _whole_lines(path)]
        new_lines = unmerged_replica_lines(self.output_lines, replica_lines, list(self._request_hashes))
        self._outputs.append_all(new_lines)
        self.output_lines.extend(new_lines)
        remove_durably(paths)
        logger.info("merged %d line(s) of %s into %s", len(new_lines), ", ".join(p.name for p in paths), OUTPUTS_FILE)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Take this part's timing summary; counts are this part's lines (abandoned requests are not counted)."""
        failed = sum(line["error"] is not None for line in self._lines_this_part)
        self._part.update(summary, requests=len(self._lines_this_part), failed_requests=failed)

    def _done_lines(self) -> list[dict[str, Any]]:
        """outputs.jsonl's lines, then those only in a per-replica file (read now: replicas may be writing)."""
        paths = replica_files(self.output_dir, REPLICA_OUTPUTS_PATTERN)
        replica_lines = [line for path in paths for line in _whole_lines(path)]
        return self.output_lines + unmerged_replica_lines(self.output_lines, replica_lines, list(self._request_hashes))

    def finish(self, status: str) -> dict[str, Any]:
        """Write summary.json for the whole run with this part's status, and return it. A complete
        run first merges what data-parallel replicas left in outputs_dp<d>.jsonl."""
        if status == "complete":
            self.merge_replica_outputs()
        if status != "running":
            self._part.update(status=status, finished_at=_now())
        served_nothing = not self._lines_this_part and "total_s" not in self._part
        parts = self._parts[:-1] if served_nothing and status == "complete" else self._parts
        lines = self._done_lines()
        done = {line["id"] for line in lines}
        pending = sum(request_id not in done for request_id in self._request_hashes)
        replica_steps = [
            line for path in replica_files(self.output_dir, REPLICA_STEPS_PATTERN) for line in _whole_lines(path)
        ]
        step_lines = _whole_lines(self.output_dir / STEPS_FILE)
        summary = run_summary(status, lines, step_lines, parts, pending, replica_steps)
        atomic_write_text(self.output_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self) -> None:
        self._outputs.close()


class ReplicaWriter:
    """What one data-parallel replica's leader writes as the replica serves: each finished request's
    line to outputs_dp<d>.jsonl (whole and fsynced before the next, with its request hash, as
    outputs.jsonl); its StepLog writes each step to the replica's step files (replica 0's are
    steps.jsonl and steps.log, whose torn line rank 0's ResultWriter drops; replica d's are
    steps_dp<d>.jsonl and steps_dp<d>.log). The replica's summary
    travels to rank 0 in the end gather. Profiling is not built for several replicas."""

    profile_dir = None

    def __init__(self, plan: RunPlan, dp_rank: int) -> None:
        self._request_hashes = plan.request_hashes
        plan.output_dir.mkdir(parents=True, exist_ok=True)  # a new run's: rank 0 may not have made it yet
        steps_name = replica_steps_file(dp_rank)
        self.step_files = StepFiles(
            plan.output_dir / replica_step_text_file(dp_rank), plan.output_dir / steps_name, plan.part
        )
        drop_torn_line(self.step_files.jsonl, plan.replica_steps.get(steps_name))  # replica 0's: ResultWriter's
        outputs_name = replica_outputs_file(dp_rank)
        self._outputs = continue_appending(
            plan.output_dir / outputs_name, plan.replica_outputs.get(outputs_name), sync=True
        )

    def write_request(self, result: dict[str, Any]) -> None:
        self._outputs.append(result | {"request_hash": self._request_hashes[result["id"]]})

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Nothing: rank 0 writes one summary over every replica's."""

    def close(self) -> None:
        self._outputs.close()


def drop_torn_line(path: Path, contents: JsonlContents | None) -> None:
    """Cut the torn last line a crash may have left in a JSONL file an earlier part wrote."""
    if contents is not None and contents.torn_tail:
        logger.warning("dropping a torn last line of %s (%d bytes) left by a crash", path.name, len(contents.torn_tail))
        drop_torn_tail(path, contents)


def continue_appending(path: Path, contents: JsonlContents | None, sync: bool) -> LineAppender:
    """An appender to a JSONL file that an earlier part may have left with a torn last line (dropped)."""
    drop_torn_line(path, contents)
    return LineAppender(path, sync=sync)


def _whole_lines(path: Path) -> list[dict[str, Any]]:
    """A per-replica file's whole lines (a torn tail left by a crash is not one). plan_run refused
    the run if a file was corrupt before it started; a file gone meanwhile holds nothing."""
    try:
        return read_jsonl(path).lines
    except (OSError, CorruptLineError) as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return []


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")
