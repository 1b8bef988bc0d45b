"""Prefill time, end-to-end throughput and prefix-cache hit rate with prefix caching off and on, in one process.

Runs our engine on dataset/shared_prefix.jsonl, where most prompts share one ~820-token system
prompt, with scheduler_config.enable_prefix_caching false and true. The batch is smaller than the
prompt list, so later batches can reuse the blocks that earlier ones computed (two prompts in the
same step do not). The runs go in the order off, on, on, off, so that a drift over the process's
life cancels out in the means. Greedy with EOS ignored, so every prompt yields --max-new-tokens
tokens. Prints JSON: per setting the figures of each run, and the on/off ratios of their means.

    python benchmarks/bench_prefix_caching.py --dtype float32 --num-prompts 40 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics

import torch
from bench_vs_transformers import add_engine_args, load_records, run_ours

from executor.model_loader.default_model import default_model_path

RATIOS = ("output_tokens_per_s", "prefill_ms_per_step_mean", "prefill_ms_total")
FIGURES = (*RATIOS, "prefix_cache_hit_rate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, num_prompts=40, batch_size=8, block_size=16, max_new_tokens=32, num_blocks=1024)
    parser.add_argument("--dataset", default="shared_prefix")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or default_model_path()
    records = load_records(args.dataset, args.num_prompts)

    runs: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    prompts: list[list[int]] = []
    for setting in ("off", "on", "on", "off"):
        figures, prompts = run_ours(args, records, scheduler_overrides={"enable_prefix_caching": setting == "on"})
        figures["prefill_ms_total"] = figures["prefill_steps"] * figures["prefill_ms_per_step_mean"]
        for name in FIGURES:
            runs[setting].setdefault(name, []).append(figures[name])
    means = {setting: {name: statistics.fmean(runs[setting][name]) for name in RATIOS} for setting in runs}
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "dtype": args.dtype,
        "dataset": args.dataset,
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "max_new_tokens": args.max_new_tokens,
        "num_blocks": args.num_blocks,
        **runs,
        "ratio_on_over_off": {name: means["on"][name] / means["off"][name] for name in RATIOS},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
