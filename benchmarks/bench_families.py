"""Decode step time of every model family's small config, eager and the best CPU graph mode, at batch 1 and 8.

Each family runs benchmarks/bench_graph_modes.py in a process of its own (one ops table and one compile
per process) on its folder's tiny random config (`models/<f>/tiny_random`, random weights) and Llama on
the real default model; prints one JSON object with each family's medians and graph speed-up.
docs/benchmarks.md records the figures, the first table of the harness's per-model profiling.

    python benchmarks/bench_families.py [--families qwen3 gpt_oss] [--modes ge_graph] [--batch-sizes 1 8]
        [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import models
from executor.core.config.model_registry import available_models
from executor.core.config.yaml_loader import load_yaml_mapping

BENCH_GRAPH_MODES = Path(__file__).with_name("bench_graph_modes.py")


def family_args(family: str, block_size: int | None) -> list[str]:
    """The default model for its own family; every other family's tiny random config, with blocks of
    `block_size` tokens or, if None, those of its tiny YAML (DeepSeek-V4's compressed layers need a
    multiple of 128)."""
    if family == models.DEFAULT_MODEL_FOLDER:
        return ["--model-name", family] + ([] if block_size is None else ["--block-size", str(block_size)])
    folder = Path(models.__file__).parent / family
    if block_size is None:
        block_size = load_yaml_mapping(folder / "config" / "tiny_random.yaml")["scheduler_config"]["block_size"]
    return ["--model-name", family, "--model-path", str(folder / "tiny_random"), "--random-weights",
            "--block-size", str(block_size)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=available_models(), choices=available_models())
    parser.add_argument("--modes", nargs="+", default=["ge_graph"], help="graph modes besides eager")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=None, help="default: the tiny YAML's (default model: 16)")
    args = parser.parse_args()
    report = {}
    for family in args.families:
        command = [sys.executable, str(BENCH_GRAPH_MODES), *family_args(family, args.block_size)]
        command.append("--skip-warm-up-timing")
        command += ["--modes", *args.modes, "--batch-sizes", *map(str, args.batch_sizes)]
        command += ["--dtype", args.dtype, "--steps", str(args.steps)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            report[family] = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
        else:
            report[family] = json.loads(done.stdout)
        print(json.dumps({family: report[family]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
