"""Where a run's results go: outputs.jsonl (one line per request, written as it finishes),
steps.jsonl (one line per step), summary.json and the resolved config."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import yaml

from executor.core.config import InferenceConfig
from executor.core.scheduler import StepRecord
from executor.core.types_ import Request
from executor.utils.model_registry import model_dir


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
    }


class ResultWriter:
    """Appends and flushes each line at once, so a crash loses no finished request."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        self._outputs: IO[str] = (output_dir / "outputs.jsonl").open("w")
        self._steps: IO[str] = (output_dir / "steps.jsonl").open("w")

    def write_config(self, config: InferenceConfig) -> None:
        resolved = {"source": config.source, **config.to_dict()}
        (self.output_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))

    def write_request(self, result: dict[str, Any]) -> None:
        self._outputs.write(json.dumps(result, ensure_ascii=False) + "\n")
        self._outputs.flush()

    def write_step(self, record: StepRecord) -> None:
        self._steps.write(json.dumps(dataclasses.asdict(record)) + "\n")
        self._steps.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        self._outputs.close()
        self._steps.close()
