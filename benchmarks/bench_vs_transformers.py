"""Throughput of our engine against transformers' `generate` on the same prompts, in one process.

Both run greedy with EOS ignored, so every prompt yields exactly --max-new-tokens tokens, and
both batch --batch-size prompts at a time (transformers with left padding). Prints JSON with
both throughputs and their ratio; docs/benchmarks.md records the figures.

    python benchmarks/bench_vs_transformers.py --dtype bfloat16 --batch-size 32
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import time

import torch
from transformers import AutoModelForCausalLM

from executor.core.config import build_config
from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DATASET_DIR, PromptRecord, load_prompts, resolve_dataset_path, tokenize_record
from executor.offline.offline_inference import OfflineInference
from executor.platform import resolve_dtype


def run_ours(
    args: argparse.Namespace,
    records: list,
    max_model_len: int = 2048,
    scheduler_overrides: dict | None = None,
    sections: dict | None = None,
) -> tuple[dict, list[list[int]]]:
    """Our engine over `records`; `sections` adds whole config sections (speculative_config, ...)."""
    config = build_config(
        {
            **(sections or {}),
            "model_config": {"model_path": str(args.model_path), "dtype": args.dtype, "device": args.device},
            "data_config": {"apply_chat_template": True, "input_truncated_len": 0},
            "scheduler_config": {
                "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": True,
                "block_size": args.block_size,
                "max_model_len": max_model_len,
                "num_blocks": args.num_blocks,
                **(scheduler_overrides or {}),
            },
        },
        source="bench",
    )
    inference = OfflineInference(config, str(args.model_path))
    prompts = [tokenize_record(r, inference.tokenizer, True) for r in records]
    start = time.perf_counter()
    result = inference.generate(records)
    elapsed = time.perf_counter() - start
    output_tokens = result.summary["output_tokens"]
    decode_ms = result.summary["decode"]["mean_ms"]
    outputs = [r.output_token_ids for r in result.requests]
    weight_bytes = sum(p.numel() * p.element_size() for p in inference.engine.worker.model.parameters())
    figures = {
        "output_tokens": output_tokens,
        "total_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "decode_ms_per_step_mean": decode_ms,
        # gpt-fast's yardstick: every decode step reads all weights once
        "decode_weight_read_gb_per_s": weight_bytes / (decode_ms * 1e-3) / 1e9,
        "prefill_ms_per_step_mean": result.summary["prefill"]["mean_ms"],
        "prefill_steps": result.summary["prefill"]["steps"],
        "prefix_cache_hit_rate": result.summary.get("prefix_cache_hit_rate"),
        "decode_output_tokens_per_s": _decode_tokens_per_s(result),
        "speculative": result.summary.get("speculative"),
        # equal digests: token-for-token equal outputs (speculation or graph modes against eager)
        "outputs_sha256": hashlib.sha256(json.dumps(outputs).encode()).hexdigest(),
    }
    del inference
    return figures, prompts


def _decode_tokens_per_s(result) -> float:
    """Tokens emitted by decode steps over the time of those steps (a prefill step emits one token
    per request that completes its prompt, and is left out on both sides)."""
    decode_ms = sum(step.step_time_ms for step in result.steps if step.phase == "decode")
    prefill_tokens = sum(1 for request in result.requests if request.output_token_ids)
    decode_tokens = result.summary["output_tokens"] - prefill_tokens
    return decode_tokens / (decode_ms / 1e3) if decode_ms else 0.0


@torch.inference_mode()
def run_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=resolve_dtype(args.dtype)).eval()
    pad_id = model.generation_config.pad_token_id or 0
    output_tokens = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), args.batch_size):
        chunk = prompts[first : first + args.batch_size]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
        )
        output_tokens += (out.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - start
    return {"output_tokens": output_tokens, "total_s": elapsed, "output_tokens_per_s": output_tokens / elapsed}


def load_records(dataset: str, num_prompts: int) -> list[PromptRecord]:
    """The first `num_prompts` records of a shipped dataset (0 = all)."""
    records = load_prompts(resolve_dataset_path(dataset, None, DATASET_DIR))
    return records[:num_prompts] if num_prompts else records


def add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    num_prompts: int,
    batch_size: int,
    block_size: int,
    max_new_tokens: int,
    num_blocks: int,
) -> None:
    """The flags every benchmark of our engine takes, with the script's defaults."""
    parser.add_argument("--model-path", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help="0 = every prompt of the dataset")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--block-size", type=int, default=block_size)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--num-blocks", type=int, default=num_blocks, help="KV blocks; 0 = size from memory")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, num_prompts=0, batch_size=32, block_size=128, max_new_tokens=64, num_blocks=0)
    parser.add_argument("--dataset", default="default")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or default_model_path()
    records = load_records(args.dataset, args.num_prompts)

    ours, prompts = run_ours(args, records)
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": args.max_new_tokens,
        "ours": ours,
    }
    if not args.skip_transformers:
        reference = run_transformers(args, prompts)
        report["transformers"] = reference
        report["ratio_ours_over_transformers"] = ours["output_tokens_per_s"] / reference["output_tokens_per_s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
