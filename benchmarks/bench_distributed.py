"""SmolLM2 on CPU at TP 1, TP 3 and DP 2: per-step time and bytes handed to each collective per step,
read from each run's step log (what the harness reports about a parallel run; on two cores the
processes share the cores, so the times show the reporting, not parallel speed).

Each layout runs `python -m executor.offline.launch` (torchrun above one process) on the first
--num-prompts prompts of dataset/default.jsonl, fp32, EOS ignored. Prints JSON: per layout and
phase, the median step time, the steps, and the mean bytes per step of each collective, over every
replica's steps for DP.

    python benchmarks/bench_distributed.py --num-prompts 4 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "models" / "llama" / "config" / "smollm2_135m.yaml"
LAYOUTS = {
    "TP 1": {},
    "TP 3": {"world_size": 3, "attn_tp_size": 3, "dense_tp_size": 3, "embed_tp_size": 3, "lmhead_tp_size": 3},
    "DP 2": {"world_size": 2},
}


def run_layout(sizes: dict[str, int], out: Path, args: argparse.Namespace) -> list[dict]:
    overrides = {
        "model_config.output_path": out,
        "data_config.num_prompts": args.num_prompts,
        "scheduler_config.batch_size": args.num_prompts,
        "scheduler_config.max_new_tokens": args.max_new_tokens,
        "scheduler_config.ignore_eos": "true",
        "scheduler_config.max_model_len": 1024,
    } | {f"parallel_config.{key}": value for key, value in sizes.items()}
    command = [sys.executable, "-m", "executor.offline.launch", "--yaml", str(CONFIG)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // sizes.get("world_size", 1)))}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    return [json.loads(line) for path in sorted(out.glob("steps*.jsonl")) for line in path.read_text().splitlines()]


def phase_figures(steps: list[dict]) -> dict[str, dict]:
    figures = {}
    for phase in ("prefill", "decode"):
        chosen = [step for step in steps if step["phase"] == phase]
        totals: defaultdict[str, int] = defaultdict(int)
        for step in chosen:
            for key, value in step["comm_bytes"].items():
                totals[key] += value
        figures[phase] = {
            "steps": len(chosen),
            "median_step_ms": statistics.median(step["step_time_ms"] for step in chosen) if chosen else 0.0,
            "mean_tokens_per_step": statistics.fmean(step["num_tokens"] for step in chosen) if chosen else 0.0,
            "comm_bytes_per_step": {key: round(total / len(chosen)) for key, total in sorted(totals.items())},
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sizes in LAYOUTS.items():
            results[name] = phase_figures(run_layout(sizes, Path(tmp) / name.replace(" ", "_"), args))
    print(json.dumps({"cpus": os.cpu_count(), **vars(args), "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
