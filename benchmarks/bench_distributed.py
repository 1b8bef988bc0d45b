"""SmolLM2 on CPU at TP 1, TP 3 and DP 2: per-step time and bytes handed to each collective per step,
read from each run's step log (what the harness reports about a parallel run; on two cores the
processes share the cores, so the times show the reporting, not parallel speed).

Each layout runs `python -m executor.offline.launch` (torchrun above one process) on the first
--num-prompts prompts of dataset/default.jsonl, fp32, EOS ignored, logprobs on. Prints JSON: per
layout and phase, the median step time, the steps, and the mean bytes per step of each collective,
over every replica's steps for DP; and per layout whether its tokens equal TP 1's, with the largest
difference of the chosen tokens' logprobs.

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


def run_layout(sizes: dict[str, int], out: Path, args: argparse.Namespace) -> tuple[list[dict], dict[str, dict]]:
    """(every step line, outputs by request id) of one run of the layout."""
    overrides = {
        "data_config.logprobs": 0,
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
    steps = [json.loads(line) for path in sorted(out.glob("steps*.jsonl")) for line in path.read_text().splitlines()]
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return steps, {line["id"]: line for line in outputs}


def against(reference: dict[str, dict], outputs: dict[str, dict]) -> dict:
    """Whether the tokens equal the reference's, and the largest logprob difference where they do."""
    same = all(outputs[i]["output_token_ids"] == line["output_token_ids"] for i, line in reference.items())
    differences = [
        abs(a["logprob"] - b["logprob"])
        for i, line in reference.items()
        for a, b in zip(line["logprobs"], outputs[i]["logprobs"], strict=False)
    ]
    return {"tokens_equal": same, "max_logprob_difference": max(differences)}


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
    reference: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sizes in LAYOUTS.items():
            steps, outputs = run_layout(sizes, Path(tmp) / name.replace(" ", "_"), args)
            reference = reference or outputs
            results[name] = phase_figures(steps) | {"vs_tp_1": against(reference, outputs)}
    print(json.dumps({"cpus": os.cpu_count(), **vars(args), "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
