"""How many of the project's Python files one greedy eager decode step passes through.

Runs the default config twice, its generate() under cProfile, with `--short` and `--long` new tokens
(EOS ignored, so every request runs to the end), and counts the files that hold a function called at least once
more for every extra decode step: the files a reader follows from the step loop to the kernel.

    python benchmarks/count_step_files.py [--short 8] [--long 40] [--yaml FILE] [--exe-mode ge_graph]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import runpy
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_YAML = ROOT / "models/llama/config/smollm2_135m.yaml"
sys.path.insert(0, str(ROOT))  # this checkout's packages, whichever one is installed

from executor.offline.offline_inference import OfflineInference  # noqa: E402 (after the path)


def call_counts(yaml: Path, max_new_tokens: int, num_prompts: int, exe_mode: str) -> dict[tuple[str, str], int]:
    """(project file, function) -> calls, over one run of the offline entry point."""
    with tempfile.TemporaryDirectory() as out:
        sys.argv = [
            "executor.offline",
            "--yaml",
            str(yaml),
            "--set",
            f"scheduler_config.max_new_tokens={max_new_tokens}",
            "--set",
            "scheduler_config.ignore_eos=true",
            "--set",
            f"data_config.num_prompts={num_prompts}",
            "--set",
            f"model_config.output_path={out}/run",
            "--set",
            f"model_config.exe_mode={exe_mode}",
        ]
        if exe_mode != "eager":  # one graph, of the run's batch, so that the compiles stay short
            sys.argv += ["--set", f"scheduler_config.batch_size={num_prompts}"]
            sys.argv += ["--set", f"scheduler_config.graph_buckets=[{num_prompts}]"]
        profiler = cProfile.Profile()
        generate = OfflineInference.generate

        def profiled_generate(self: OfflineInference, *args: Any, **kwargs: Any) -> Any:
            """The run's generate() under the profiler: its steps, not the build, warm-up or compiles."""
            profiler.enable()
            try:
                return generate(self, *args, **kwargs)
            finally:
                profiler.disable()

        OfflineInference.generate = profiled_generate  # type: ignore[method-assign]
        with open(Path(out) / "console.txt", "w") as console, contextlib.redirect_stdout(console):
            try:
                runpy.run_module("executor.offline", run_name="__main__", alter_sys=True)
            except SystemExit as stop:
                if stop.code not in (0, None):
                    raise
            finally:
                OfflineInference.generate = generate  # type: ignore[method-assign]
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for (filename, _, function), (_, total_calls, *_rest) in pstats.Stats(profiler).stats.items():
        path = Path(filename)
        if path.suffix == ".py" and path.is_relative_to(ROOT) and ".venv" not in path.parts:
            counts[(str(path.relative_to(ROOT)), function)] += total_calls
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--yaml", type=Path, default=DEFAULT_YAML)
    parser.add_argument("--exe-mode", default="eager", choices=["eager", "ge_graph", "npugraph_ex"])
    args = parser.parse_args()
    short = call_counts(args.yaml, args.short, args.num_prompts, args.exe_mode)
    long = call_counts(args.yaml, args.long, args.num_prompts, args.exe_mode)
    extra_steps = args.long - args.short
    per_step: dict[str, list[str]] = defaultdict(list)
    for key, calls in long.items():
        if calls - short.get(key, 0) >= extra_steps:
            per_step[key[0]].append(key[1])
    print(f"{len(per_step)} project files hold a function called on every decode step:")
    for file in sorted(per_step):
        print(f"  {file}: {', '.join(sorted(per_step[file]))}")


if __name__ == "__main__":
    main()
