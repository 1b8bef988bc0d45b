"""The grammar's cost per decode step against the step itself, at batch 32 on the default model.

One engine runs the same prompts twice: free, then every request under one JSON schema (an array
of at least 8 objects, so that the grammar is live for every one of the 32 new tokens). It prints
the decode step's mean time of each run, the host time the constraints took per step (filling each
row's bitmask with xgrammar, applying it, LogitsConstraints.stats) and its share of the free
run's decode step; the goal is under 5%.

    python benchmarks/bench_structured_output.py --dtype bfloat16 --exe-mode ge_graph --graph-buckets 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import subprocess

import torch
from bench_vs_transformers import add_engine_args, build_inference, load_records

from executor.model_loader.default_model import default_model_path
from executor.types_.structured_output import parse_structured_output

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16}, "score": {"type": "integer"}},
                "required": ["name", "score"],
            },
            "minItems": 8,
        }
    },
    "required": ["items"],
}


def cpu_name() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, num_prompts=32, batch_size=32, block_size=16, max_new_tokens=32, num_blocks=1024)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or default_model_path()
    inference = build_inference(args)
    records = load_records("default", args.num_prompts)
    records = [
        dataclasses.replace(records[index % len(records)], id=f"free-{index}") for index in range(args.num_prompts)
    ]
    free = inference.generate(records)
    spec = parse_structured_output({"guided_json": SCHEMA})
    constrained = inference.generate(
        [
            dataclasses.replace(record, id=f"json-{index}", sampling_overrides={"structured_output": spec})
            for index, record in enumerate(records)
        ]
    )
    stats = constrained.summary["structured_output"]
    free_ms = free.summary["decode"]["mean_ms"]
    report = {
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "dtype": args.dtype,
        "exe_mode": args.exe_mode,
        "batch_size": args.batch_size,
        "decode_ms_per_step_free": free_ms,
        "decode_ms_per_step_with_grammar": constrained.summary["decode"]["mean_ms"],
        "grammar_ms_per_step": stats["mask_ms_per_step"],
        "grammar_share_of_free_step": stats["mask_ms_per_step"] / free_ms,
        "grammar_compile_ms_max": stats["compile_ms_max"],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
