"""Where a step's time goes: torch.profiler over one prefill step of every request and over eager
decode steps of the default model; then the decode step time with the CPU decode attention kernel
and with the gathered torch reference, interleaved (reference, kernel, kernel, reference).

    python benchmarks/profile_decode_step.py --batch-size 32 --prompt-tokens 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from unittest import mock

import torch
from bench_graph_modes import decode_ms
from transformers import LlamaConfig

from executor.core.config import build_config
from executor.core.engine.engine import ExecutionEngine
from executor.core.types_ import Batch, Request, SamplingParams
from executor.model_loader.default_model import default_model_path
from models.llama import LlamaForCausalLM
from ops import cpu_kernels


def build_engine(dtype: str, batch_size: int) -> ExecutionEngine:
    """An eager engine on the default model with room for `batch_size` requests of max_model_len."""
    model_path = default_model_path()
    config = build_config(
        {
            "model_config": {"model_path": str(model_path), "dtype": dtype, "device": "cpu"},
            "scheduler_config": {
                "batch_size": batch_size,
                "block_size": 16,
                "max_model_len": 512,
                "num_blocks": batch_size * 32 + 1,
            },
        },
        source="profile_decode_step",
    )
    engine = ExecutionEngine(config)
    engine.init(LlamaForCausalLM, LlamaConfig, str(model_path))
    return engine


def prefilled(engine: ExecutionEngine, batch_size: int, prompt_tokens: int) -> list[Request]:
    """`batch_size` requests of about `prompt_tokens` tokens, prefilled together in one step."""
    requests = []
    for index in range(batch_size):
        prompt = [(7 * index + position) % 1000 + 10 for position in range(prompt_tokens + index % 7)]
        request = Request(f"r{index}", None, prompt, SamplingParams(max_new_tokens=1 << 20))
        assert engine.kv_cache_manager.allocate_slots(request, request.num_tokens) is not None
        requests.append(request)
    new_tokens = engine.forward_batch(Batch(requests, [r.num_tokens for r in requests], is_prefill=True))
    for request, tokens in zip(requests, new_tokens, strict=True):
        request.num_computed_tokens = request.num_tokens
        request.output_token_ids.extend(tokens)
    return requests


def attention(reference: bool) -> contextlib.AbstractContextManager:
    """Decode attention through the gathered torch reference (the CPU kernel hidden), or as built."""
    if reference:
        return mock.patch.object(cpu_kernels, "paged_decode_attention", lambda: None)
    return contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15, help="operators in the printed table")
    parser.add_argument("--profile-reference", action="store_true", help="profile decode without the CPU kernel")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = build_engine(args.dtype, args.batch_size)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        requests = prefilled(engine, args.batch_size, args.prompt_tokens)
        prefill_ms = (time.perf_counter() - start) * 1e3
    print(f"prefill of {args.batch_size} requests in one step: {prefill_ms:.0f} ms (profiled)")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    decode_ms(engine, requests, 2)  # warm

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with attention(args.profile_reference):
            profiled_ms = decode_ms(engine, requests, args.steps)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))

    timings: dict[str, list[float]] = {"reference": [], "kernel": []}
    for variant in ("reference", "kernel", "kernel", "reference"):
        with attention(variant == "reference"):
            timings[variant] += decode_ms(engine, requests, args.steps)
    median = {variant: statistics.median(ms) for variant, ms in timings.items()}
    report = {
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "kv_tokens_per_request": requests[0].num_computed_tokens,
        "threads": torch.get_num_threads(),
        "profiled_ms_per_step": statistics.mean(profiled_ms),
        "decode_ms_per_step_median": median,
        "reference_over_kernel": median["reference"] / median["kernel"],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
