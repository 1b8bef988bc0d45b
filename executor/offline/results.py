"""Where a run's results go: outputs.jsonl (one line per request, written as it finishes),
steps.jsonl (one line per step), summary.json and the resolved config.yaml, in one run folder."""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from executor.core.config import InferenceConfig
from executor.core.scheduler import StepRecord
from executor.core.types_ import Request, SamplingParams
from executor.offline.dataset import PromptRecord
from executor.offline.durable_io import LineAppender, atomic_write_text, drop_torn_tail
from executor.offline.run_folder import CONFIG_FILE, OUTPUTS_FILE, STEPS_FILE, SUMMARY_FILE, RunPlan
from executor.offline.run_summary import run_summary
from executor.utils.model_registry import model_dir

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
        "finish_reason": request.finish_reason.value if request.finish_reason else None,
        "error": request.error,
        "logprobs": _logprobs_result(request),
    }


def _logprobs_result(request: Request) -> list[dict[str, Any]] | None:
    """Per output token: its logprob and the top ones as [token id, logprob] pairs (docs/sampling.md);
    None when the request asked for none. A step that samples several rows of a request may
    sample past a stop token, whose tokens are dropped: their logprobs are cut here alike."""
    if request.sampling_params.logprobs is None:
        return None
    return [
        {
            "token_id": entry.token_id,
            "logprob": entry.logprob,
            "top": [list(pair) for pair in zip(entry.top_token_ids, entry.top_logprobs, strict=True)],
        }
        for entry in request.output_logprobs[: len(request.output_token_ids)]
    ]


def failed_record_result(record: PromptRecord) -> dict[str, Any]:
    """The outputs line of a dataset record that cannot be served (its error says why)."""
    assert record.error is not None
    request = Request(record.id, None, [], SamplingParams())
    request.fail(record.error, now_s=0.0)
    return request_result(request, "")


class ResultWriter:
    """Writes the run folder that `plan` describes, continuing what earlier parts left there.

    outputs.jsonl lines are written whole and fsynced as each request finishes; steps.jsonl lines
    are written whole (a crash may lose the last few, which only time the run); config.yaml and
    summary.json are replaced atomically. summary.json says "running" until finish() is called, so
    a folder whose summary still says so after its process is gone was killed.
    """

    def __init__(self, plan: RunPlan, config: InferenceConfig) -> None:
        self.output_dir = plan.output_dir
        self._request_hashes = plan.request_hashes
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name, contents in ((OUTPUTS_FILE, plan.outputs), (STEPS_FILE, plan.steps)):
            if contents.torn_tail:
                logger.warning(
                    "dropping a torn last line of %s (%d bytes) left by a crash", name, len(contents.torn_tail)
                )
                drop_torn_tail(self.output_dir / name, contents)
        resolved = {"source": config.source, **config.to_dict()}
        atomic_write_text(self.output_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
        self._outputs = LineAppender(self.output_dir / OUTPUTS_FILE, sync=True)
        self._steps = LineAppender(self.output_dir / STEPS_FILE, sync=False)
        self.output_lines = list(plan.outputs.lines)
        self._step_lines = list(plan.steps.lines)
        earlier_parts = plan.earlier_summary.get("parts", [])
        self._parts = [
            part | {"status": "killed"} if part.get("status") == "running" else part for part in earlier_parts
        ]
        self._part: dict[str, Any] = {"part": len(self._parts) + 1, "status": "running", "started_at": _now()}
        self._parts.append(self._part)
        self._lines_this_part: list[dict[str, Any]] = []
        self.finish("running")

    def write_request(self, result: dict[str, Any]) -> None:
        line = result | {"request_hash": self._request_hashes[result["id"]]}
        self._outputs.append(line)
        self.output_lines.append(line)
        self._lines_this_part.append(line)

    def write_step(self, record: StepRecord) -> None:
        line = {"part": self._part["part"], **dataclasses.asdict(record)}
        self._steps.append(line)
        self._step_lines.append(line)

    def write_replica_steps(self, dp_rank: int, records: list[StepRecord]) -> None:
        """Another data-parallel replica's step log, kept apart in steps_dp<rank>.jsonl (replica 0's
        is steps.jsonl): step numbers and times of different replicas do not line up."""
        appender = LineAppender(self.output_dir / f"steps_dp{dp_rank}.jsonl", sync=False)
        try:
            for record in records:
                appender.append({"part": self._part["part"], **dataclasses.asdict(record)})
        finally:
            appender.close()

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Take this part's timing summary; counts are this part's lines (abandoned requests are not counted)."""
        failed = sum(line["error"] is not None for line in self._lines_this_part)
        self._part.update(summary, requests=len(self._lines_this_part), failed_requests=failed)

    @property
    def pending_requests(self) -> int:
        done = {line["id"] for line in self.output_lines}
        return sum(request_id not in done for request_id in self._request_hashes)

    def finish(self, status: str) -> dict[str, Any]:
        """Write summary.json for the whole run with this part's status, and return it."""
        if status != "running":
            self._part.update(status=status, finished_at=_now())
        served_nothing = not self._lines_this_part and "total_s" not in self._part
        parts = self._parts[:-1] if served_nothing and status == "complete" else self._parts
        summary = run_summary(status, self.output_lines, self._step_lines, parts, self.pending_requests)
        atomic_write_text(self.output_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self) -> None:
        self._outputs.close()
        self._steps.close()


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")
