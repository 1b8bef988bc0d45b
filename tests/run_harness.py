"""Runs of the command line into one output folder, for the resume and interrupt tests."""

from __future__ import annotations

import json
from pathlib import Path

from executor.offline import __main__ as cli

NUM_PROMPTS = 10


def write_run(tmp_path: Path, model_dir: Path, num_prompts: int = NUM_PROMPTS, seed: int = 0) -> Path:
    """A run.yaml over `num_prompts` token-id prompts; requests finish in several waves."""
    dataset = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"r{i}", "prompt_token_ids": [3 + i, 4 + 2 * i, 5]}) for i in range(num_prompts)]
    dataset.write_text("\n".join(lines) + "\n")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        f"model_config:\n  model_path: {model_dir}\n  dtype: float32\n  device: cpu\n"
        f"data_config:\n  dataset_path: {dataset}\n  seed: {seed}\n"
        "scheduler_config:\n  batch_size: 3\n  max_new_tokens: 6\n  block_size: 16\n  ignore_eos: true\n"
    )
    return run_yaml


def run_into(run_yaml: Path, out: Path, *overrides: str) -> int:
    argv = ["--yaml", str(run_yaml), "--set", f"model_config.output_path={out}"]
    for override in overrides:
        argv += ["--set", override]
    return cli.main(argv)


def outputs_by_id(out: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert len(by_id) == len(lines), "a request has two lines"
    return by_id


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())
