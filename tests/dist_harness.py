"""Runs of the offline entry under torchrun (gloo on CPU) for the distributed tests, and the
one-process run each is compared with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.run_harness import outputs_by_id, run_into

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 420


@dataclass(slots=True)
class DistRun:
    returncode: int
    output: str  # stdout and stderr together
    out: Path

    def outputs(self) -> dict[str, dict]:
        return outputs_by_id(self.out)

    def output_ids_in_file_order(self) -> list[str]:
        return [json.loads(line)["id"] for line in (self.out / "outputs.jsonl").read_text().splitlines()]

    def steps(self, name: str = "steps.jsonl") -> list[dict]:
        return [json.loads(line) for line in (self.out / name).read_text().splitlines()]


def parallel_overrides(world_size: int, **sizes: int) -> list[str]:
    return [f"parallel_config.world_size={world_size}"] + [f"parallel_config.{k}={v}" for k, v in sizes.items()]


def run_distributed(
    run_yaml: Path,
    out: Path,
    overrides: list[str],
    entry: list[str] | None = None,
    nproc: int | None = None,
    env: dict[str, str] | None = None,
) -> DistRun:
    """`python -m executor.offline.launch` (which starts torchrun), or with `entry` and `nproc`
    torchrun over that entry directly, with `env` added to the environment; waits at most RUN_TIMEOUT_S."""
    command = launch_command(run_yaml, out, overrides, entry, nproc)
    done = subprocess.run(
        command, cwd=ROOT, env=RUN_ENV | (env or {}), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    return DistRun(done.returncode, done.stdout + done.stderr, out)


RUN_ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def entry_args(run_yaml: Path, out: Path, overrides: list[str]) -> list[str]:
    """The offline entry's arguments for a run of `run_yaml` into `out` with `overrides`."""
    args = ["--yaml", str(run_yaml), "--set", f"model_config.output_path={out}"]
    for override in overrides:
        args += ["--set", override]
    return args


def launch_command(
    run_yaml: Path, out: Path, overrides: list[str], entry: list[str] | None = None, nproc: int | None = None
) -> list[str]:
    args = entry_args(run_yaml, out, overrides)
    if entry is None:
        return [sys.executable, "-m", "executor.offline.launch", *args]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*command, *entry, *args]


def run_in_one_launch(runs: list[list[str]], nproc: int, runs_file: Path) -> subprocess.CompletedProcess:
    """torchrun over tests/dist_runs_entry.py: the offline entry with each of `runs` (entry_args
    lists, written to `runs_file`) in turn, in one process group of `nproc` ranks."""
    runs_file.write_text(json.dumps(runs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["tests/dist_runs_entry.py", str(runs_file)]
    return subprocess.run(
        command, cwd=ROOT, env=RUN_ENV, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )


def start_distributed(run_yaml: Path, out: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    """`python -m executor.offline.launch` started in a process group of its own, as a terminal starts
    a command (so that os.killpg(process.pid, SIGINT) is a Ctrl-C), its output going to `log`."""
    with log.open("w") as log_file:
        return subprocess.Popen(
            launch_command(run_yaml, out, overrides),
            cwd=ROOT,
            env=RUN_ENV,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_one_process(run_yaml: Path, out: Path, *overrides: str) -> dict[str, dict]:
    assert run_into(run_yaml, out, *overrides) == 0
    return outputs_by_id(out)


def token_ids(outputs: dict[str, dict]) -> dict[str, list[int]]:
    return {request_id: line["output_token_ids"] for request_id, line in outputs.items()}


def max_logprob_difference(first: dict[str, dict], second: dict[str, dict]) -> float:
    """The largest difference between the two runs' logprobs of the tokens they chose (same tokens)."""
    return max(
        abs(a["logprob"] - b["logprob"])
        for request_id in first
        for a, b in zip(first[request_id]["logprobs"], second[request_id]["logprobs"], strict=True)
    )
