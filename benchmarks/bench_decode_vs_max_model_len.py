"""Decode step time with a short and a long max_model_len, in one process.

Block tables are cdiv(max_model_len, block_size) wide so that decode shapes never change, and
the decode attention op must still touch only the real K/V: the runs below differ only in
max_model_len (same prompts, same KV block count), so their decode times should be about equal.
The runs go in the order short, long, long, short, and each length's figure is the mean of its
two runs, so that a drift over the process's life (a later run is often slower) cancels out.

    python benchmarks/bench_decode_vs_max_model_len.py --dtype float32 --short 1024 --long 8192
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, num_prompts=32, batch_size=32, block_size=16, max_new_tokens=32, num_blocks=1024)
    parser.add_argument("--short", type=int, default=1024, help="the short max_model_len")
    parser.add_argument("--long", type=int, default=8192, help="the long max_model_len")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or default_model_path()
    records = load_records("default", args.num_prompts)
    decode_ms: dict[int, list[float]] = {args.short: [], args.long: []}
    for length in (args.short, args.long, args.long, args.short):
        decode_ms[length].append(run_ours(args, records, max_model_len=length)[0]["decode_ms_per_step_mean"])
    short_ms, long_ms = (statistics.fmean(decode_ms[length]) for length in (args.short, args.long))
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "decode_ms_per_step": {str(length): times for length, times in decode_ms.items()},
        "ratio_long_over_short": long_ms / short_ms,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
