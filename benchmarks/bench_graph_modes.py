"""Decode step time in eager mode and each graph mode, at several batch sizes, and warm-up times.

For each exe_mode an engine is built with one graph bucket per measured batch size. Warm-up time
is measured in child processes, first with an empty compile cache and then with the cache the
first one filled; the step timings run in this process, all engines side by side, in the order
eager, graphs..., graphs reversed, eager (ABBA) so that drift over the process's life cancels.
A step is timed whole (host input preparation, copies, forward, argmax and its host sync), on
requests with ~100-token prompts. Prints JSON; docs/graph_modes.md records the figures.

    python benchmarks/bench_graph_modes.py --dtype float32 --batch-sizes 1 8 32

With --verify-tokens K the graph modes' engines are built with n-gram speculation of K drafts, so
each batch size has a verify bucket of 1 + K tokens per request too, and a verify step (each
request's last token and K drafts) is timed beside the one-token decode step, interleaved: the
cost ratio of a verify step in a graph to a decode step in a graph at the same batch size.
--profile-verify prints torch.profiler's tables of the decode and the verify steps of the first graph mode.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from executor.core.config import build_config
from executor.core.engine.engine import ExecutionEngine
from executor.model_loader.default_model import default_model_path
from executor.types_ import Request, SamplingParams

PROMPT_TOKENS = 100
MAX_MODEL_LEN = 1024
GRAPH_MODES = ("ge_graph", "npugraph_ex")


def build_engine(args: argparse.Namespace, exe_mode: str, cache_dir: str) -> ExecutionEngine:
    config = build_config(
        {
            "model_config": {
                "model_name": args.model_name,
                "model_path": str(args.model_path),
                "with_ckpt": not args.random_weights,
                "dtype": args.dtype,
                "device": "cpu",
                "exe_mode": exe_mode,
                "enable_cache_compile": True,
                "compile_cache_dir": cache_dir,
            },
            "scheduler_config": {
                "batch_size": max(args.batch_sizes),
                "graph_buckets": args.batch_sizes,
                "block_size": args.block_size,
                "max_model_len": MAX_MODEL_LEN,
                "num_blocks": num_blocks(args),
            },
            "speculative_config": (
                {"method": "ngram", "num_speculative_tokens": args.verify_tokens}
                if args.verify_tokens and exe_mode != "eager"
                else {}
            ),
        },
        source="bench_graph_modes",
    )
    engine = ExecutionEngine(config, str(args.model_path))
    return engine


def num_blocks(args: argparse.Namespace) -> int:
    """Each request's ~106 + (2 + 2 K) x steps tokens (K: --verify-tokens) with room to spare, and one
    max_model_len request (the pool's own check) beside the null block."""
    per_request = -(-(PROMPT_TOKENS + 7 + (2 + 2 * args.verify_tokens) * args.steps) // args.block_size) + 4
    return max(args.batch_sizes) * per_request + -(-MAX_MODEL_LEN // args.block_size) + 1


def prefilled(engine: ExecutionEngine, batch_size: int) -> list[Request]:
    """`batch_size` requests with prompts of about PROMPT_TOKENS tokens, prefilled one by one."""
    requests = []
    for index in range(batch_size):
        prompt = [(7 * index + position) % 1000 + 10 for position in range(PROMPT_TOKENS + index % 7)]
        request = Request(f"r{index}", None, prompt, SamplingParams(max_new_tokens=1 << 20))
        assert engine.kv_cache_manager.allocate_slots(request, request.num_tokens) is not None
        (tokens,) = engine.runner.execute(
            engine.kv_cache_manager.batch([request], [request.num_tokens], is_prefill=True)
        ).new_token_ids
        request.num_computed_tokens = request.num_tokens
        request.output_token_ids.extend(tokens)
        requests.append(request)
    return requests


def decode_ms(engine: ExecutionEngine, requests: list[Request], steps: int) -> list[float]:
    """Per-step milliseconds of `steps` decode steps of all `requests` together."""
    times = []
    for _ in range(steps):
        for request in requests:
            assert engine.kv_cache_manager.allocate_slots(request, 1) is not None
        batch = engine.kv_cache_manager.batch(requests, [1] * len(requests), is_prefill=False)
        start = time.perf_counter()
        new_tokens = engine.runner.execute(batch).new_token_ids
        times.append((time.perf_counter() - start) * 1e3)
        for request, tokens in zip(requests, new_tokens, strict=True):
            request.num_computed_tokens += 1
            request.output_token_ids.extend(tokens)
    return times


def verify_ms(engine: ExecutionEngine, requests: list[Request], steps: int, drafts: int) -> list[float]:
    """Per-step milliseconds of `steps` verify steps of all `requests`, each feeding its last token
    and `drafts` draft tokens (its own last tokens again: what is drafted does not change the cost);
    the requests then advance by one token, as if every draft were rejected."""
    times = []
    for _ in range(steps):
        for request in requests:
            assert engine.kv_cache_manager.allocate_slots(request, 1 + drafts) is not None
        draft_token_ids = [
            request.token_ids_between(request.num_tokens - drafts, request.num_tokens) for request in requests
        ]
        batch = engine.kv_cache_manager.batch(
            requests, [1 + drafts] * len(requests), is_prefill=False, draft_token_ids=draft_token_ids
        )
        start = time.perf_counter()
        new_tokens = engine.runner.execute(batch).new_token_ids
        times.append((time.perf_counter() - start) * 1e3)
        for request, tokens in zip(requests, new_tokens, strict=True):
            request.num_computed_tokens += 1
            request.output_token_ids.extend(tokens[:1])
            engine.kv_cache_manager.free_tail(request, request.num_tokens)
    return times


def warm_up_seconds(args: argparse.Namespace, exe_mode: str, cache_dir: str) -> float:
    """Graph warm-up time of a fresh process (so only the on-disk cache can help)."""
    command = [sys.executable, __file__, "--warm-up-only", exe_mode, "--cache-dir", cache_dir, "--dtype", args.dtype]
    command += ["--model-path", str(args.model_path), "--batch-sizes", *map(str, args.batch_sizes)]
    command += ["--block-size", str(args.block_size), "--steps", str(args.steps)]
    command += ["--model-name", args.model_name] + (["--random-weights"] if args.random_weights else [])
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="HF model folder (default: the default model)")
    parser.add_argument("--model-name", default="", help="model_config.model_name (default: the default model's)")
    parser.add_argument("--random-weights", action="store_true", help="with_ckpt false: the folder's config.json only")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", nargs="+", default=list(GRAPH_MODES), choices=GRAPH_MODES)
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size and pass")
    parser.add_argument(
        "--block-size", type=int, default=16, help="scheduler_config.block_size (a model may need a multiple of 128)"
    )
    parser.add_argument("--cache-dir", default=None, help="compile cache (default: a new temporary folder)")
    parser.add_argument("--skip-warm-up-timing", action="store_true", help="time decode steps only")
    parser.add_argument("--warm-up-timing-only", action="store_true", help="time warm-up (cold, warm cache) only")
    parser.add_argument("--verify-tokens", type=int, default=0, help="K: also time verify steps of 1 + K tokens")
    parser.add_argument(
        "--profile-verify", action="store_true", help="profile the first graph mode's decode, verify steps"
    )
    parser.add_argument("--warm-up-only", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or default_model_path()
    args.batch_sizes = sorted(args.batch_sizes)
    if args.warm_up_only:
        engine = build_engine(args, args.warm_up_only, args.cache_dir)
        print(engine.worker.graph_runner.warm_up_s)
        return

    if args.cache_dir:
        measure(args, args.cache_dir)
        return
    with tempfile.TemporaryDirectory(prefix="bench-graph-cache-") as cache_dir:
        measure(args, cache_dir)


def measure(args: argparse.Namespace, cache_dir: str) -> None:
    """Warm-up times, then the step timings; prints the report."""
    warm_up = {
        mode: {"cold_s": warm_up_seconds(args, mode, cache_dir), "warm_cache_s": warm_up_seconds(args, mode, cache_dir)}
        for mode in ([] if args.skip_warm_up_timing else args.modes)
    }
    if args.warm_up_timing_only:
        print(json.dumps({"dtype": args.dtype, "buckets": args.batch_sizes, "warm_up_s": warm_up}, indent=2))
        return
    engines = {mode: build_engine(args, mode, cache_dir) for mode in ("eager", *args.modes)}
    order = [*engines, *reversed(engines)]
    step_ms: dict[str, dict[int, list[float]]] = {mode: {b: [] for b in args.batch_sizes} for mode in engines}
    verify_step_ms: dict[str, dict[int, list[float]]] = {mode: {b: [] for b in args.batch_sizes} for mode in args.modes}
    for batch_size in args.batch_sizes:
        requests = {mode: prefilled(engine, batch_size) for mode, engine in engines.items()}
        for mode in order:
            step_ms[mode][batch_size] += decode_ms(engines[mode], requests[mode], args.steps)
            if args.verify_tokens and mode != "eager":
                times = verify_ms(engines[mode], requests[mode], args.steps, args.verify_tokens)
                verify_step_ms[mode][batch_size] += times
        if args.profile_verify and args.verify_tokens:
            mode = args.modes[0]
            steps = {
                "decode": functools.partial(decode_ms, engines[mode], requests[mode], 5),
                "verify": functools.partial(verify_ms, engines[mode], requests[mode], 5, args.verify_tokens),
            }
            for kind, run_steps in steps.items():
                with torch.profiler.profile() as profile:
                    run_steps()
                print(f"{mode}, batch {batch_size}, 5 {kind} steps:", file=sys.stderr)
                print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
        for mode, engine in engines.items():
            for request in requests[mode]:
                engine.kv_cache_manager.free(request)
    median = {mode: {b: statistics.median(t) for b, t in by_batch.items()} for mode, by_batch in step_ms.items()}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "model": f"{args.model_name or 'default'} ({args.model_path})",
        "dtype": args.dtype,
        "prompt_tokens": f"{PROMPT_TOKENS}-{PROMPT_TOKENS + 6}",
        "decode_ms_per_step_median": median,
        "speedup_over_eager": {
            mode: {b: median["eager"][b] / ms for b, ms in by_batch.items()}
            for mode, by_batch in median.items()
            if mode != "eager"
        },
        "warm_up_s": warm_up,
    }
    if args.verify_tokens:
        verify_median = {mode: {b: statistics.median(t) for b, t in by.items()} for mode, by in verify_step_ms.items()}
        report["verify_tokens_per_request"] = 1 + args.verify_tokens
        report["verify_ms_per_step_median"] = verify_median
        report["verify_over_decode"] = {
            mode: {b: ms / median[mode][b] for b, ms in by_batch.items()} for mode, by_batch in verify_median.items()
        }
        report["graph_steps"] = {mode: engines[mode].graph_stats() for mode in args.modes}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
