"""Where a step's time goes: torch.profiler over one prefill step of every request and over eager
decode steps of the default model; then the decode step time as built against one part swapped
for its baseline, interleaved (baseline, built, built, baseline): `--baseline attention` runs the
gathered torch reference instead of the CPU decode attention kernel, `--baseline weights` MKL on
the plain linear weights instead of the packed copies (ops/cpu.py), `--baseline
onednn` oneDNN's blocked copies instead of the AVX2 panels, `--baseline fused` the torch
reference's separate ops instead of the fused CPU kernels. Each baseline swaps the layers' backend
record (or their linear methods) for the time it runs.
`--baseline prefill_attention` times whole prefill steps instead (fresh requests each time), the
per-request torch loop against the CPU prefill attention kernel, and the attention calls within them.

    python benchmarks/profile_decode_step.py --batch-size 32 --prompt-tokens 200 --baseline weights
    python benchmarks/profile_decode_step.py --batch-size 32 --prompt-tokens 150 --baseline prefill_attention
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from bench_graph_modes import decode_ms

from executor.core.config import build_config
from executor.core.engine.engine import ExecutionEngine
from executor.model_loader.default_model import default_model_path
from executor.types_ import Request, SamplingParams
from ops import torch_ref
from ops.attention.reference import ReferenceAttention
from ops.backend import Backend
from ops.cpu import OneDnnLinear
from ops.linear_method import LinearMethod, PlainLinear


def build_engine(
    dtype: str, batch_size: int, quantization: str = "", model_path: Path | None = None
) -> ExecutionEngine:
    """An eager engine on `model_path` (default: the default model) with room for `batch_size` requests
    of max_model_len, its weights quantized at load by `quantization` (model_config.quantization; "" for none)."""
    model_path = model_path or default_model_path()
    config = build_config(
        {
            "model_config": {
                "model_path": str(model_path),
                "dtype": dtype,
                "device": "cpu",
                "quantization": quantization,
            },
            "scheduler_config": {
                "batch_size": batch_size,
                "block_size": 16,
                "max_model_len": 512,
                "num_blocks": batch_size * 32 + 1,
            },
        },
        source="profile_decode_step",
    )
    engine = ExecutionEngine(config, str(model_path))
    return engine


def prefilled(engine: ExecutionEngine, batch_size: int, prompt_tokens: int) -> list[Request]:
    """`batch_size` requests of about `prompt_tokens` tokens, prefilled together in one step."""
    requests = []
    for index in range(batch_size):
        prompt = [(7 * index + position) % 1000 + 10 for position in range(prompt_tokens + index % 7)]
        request = Request(f"r{index}", None, prompt, SamplingParams(max_new_tokens=1 << 20))
        assert engine.kv_cache_manager.allocate_slots(request, request.num_tokens) is not None
        requests.append(request)
    new_tokens = engine.runner.execute(
        engine.kv_cache_manager.batch(requests, [r.num_tokens for r in requests], is_prefill=True)
    ).new_token_ids
    for request, tokens in zip(requests, new_tokens, strict=True):
        request.num_computed_tokens = request.num_tokens
        request.output_token_ids.extend(tokens)
    return requests


def prefill_step_ms(engine: ExecutionEngine, batch_size: int, prompt_tokens: int) -> float:
    """Milliseconds of one prefill step of `batch_size` new requests, whose blocks are freed after."""
    start = time.perf_counter()
    requests = prefilled(engine, batch_size, prompt_tokens)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    for request in requests:
        engine.kv_cache_manager.free(request)
    return elapsed_ms


@contextlib.contextmanager
def swapped_ops(model: torch.nn.Module, **ops: object) -> Iterator[None]:
    """Every layer of `model` that calls its backend's ops on a copy of that record with `ops` replaced."""
    layers = [module for module in model.modules() if isinstance(getattr(module, "ops", None), Backend)]
    records = [layer.ops for layer in layers]
    for layer, record in zip(layers, records, strict=True):
        layer.ops = dataclasses.replace(record, **ops)
    try:
        yield
    finally:
        for layer, record in zip(layers, records, strict=True):
            layer.ops = record


@contextlib.contextmanager
def swapped_attention(model: torch.nn.Module, attention: object) -> Iterator[None]:
    """Every attention layer of `model` on the attention backend `attention`, its own set aside meanwhile."""
    layers = [module for module in model.modules() if hasattr(module, "attention") and hasattr(module, "kv_scales")]
    previous = [layer.attention for layer in layers]
    for layer in layers:
        layer.attention = attention
    try:
        yield
    finally:
        for layer, own in zip(layers, previous, strict=True):
            layer.attention = own


class ReferencePrefill:
    """`attention` with any non-decode step through the reference's per-request loop."""

    def __init__(self, attention: object) -> None:
        self.attention = attention

    def write(self, *args: object) -> None:
        self.attention.write(*args)

    def forward(self, layer, query, key, value, metadata) -> torch.Tensor:
        if metadata.is_decode_shaped:
            return self.attention.forward(layer, query, key, value, metadata)
        return ReferenceAttention().forward(layer, query, key, value, metadata)


class TimedAttention:
    """`attention` with the wall time of every forward (any layer, any step shape) appended to `seconds`."""

    def __init__(self, attention: object, seconds: list[float]) -> None:
        self.attention = attention
        self.seconds = seconds

    def write(self, *args: object) -> None:
        self.attention.write(*args)

    def forward(self, *args: object) -> torch.Tensor:
        start = time.perf_counter()
        output = self.attention.forward(*args)
        self.seconds.append(time.perf_counter() - start)
        return output


def timed_attention(engine: ExecutionEngine, seconds: list[float]) -> contextlib.AbstractContextManager:
    """Appends the wall time of every paged attention call (any layer, any step shape) to `seconds`."""
    model = engine.worker.model
    attention = next(m.attention for m in model.modules() if hasattr(m, "attention") and hasattr(m, "kv_scales"))
    return swapped_attention(model, TimedAttention(attention, seconds))


def prefill_timings(engine: ExecutionEngine, args: argparse.Namespace) -> dict[str, object]:
    """Prefill steps with the torch loop (baseline) and the CPU kernel (built), interleaved."""
    step_ms: dict[str, list[float]] = {"baseline": [], "built": []}
    attention_ms: dict[str, list[float]] = {"baseline": [], "built": []}
    for variant in ("baseline", "built", "built", "baseline"):
        for _ in range(args.steps):
            seconds: list[float] = []
            with baseline(engine, args.baseline) if variant == "baseline" else contextlib.nullcontext():
                with timed_attention(engine, seconds):
                    step_ms[variant].append(prefill_step_ms(engine, args.batch_size, args.prompt_tokens))
            attention_ms[variant].append(sum(seconds) * 1e3)
    step = {variant: statistics.median(ms) for variant, ms in step_ms.items()}
    attention = {variant: statistics.median(ms) for variant, ms in attention_ms.items()}
    return {
        "prefill_ms_per_step_median": step,
        "attention_ms_per_step_median": attention,
        "step_baseline_over_built": step["baseline"] / step["built"],
        "attention_baseline_over_built": attention["baseline"] / attention["built"],
    }


@contextlib.contextmanager
def swapped_weights(model: torch.nn.Module, method: LinearMethod) -> Iterator[None]:
    """Linear layers through `method` (PlainLinear: MKL on the plain weights; OneDnnLinear: oneDNN's
    blocked copies), their own methods and packed copies set aside meanwhile."""
    layers = [module for module in model.modules() if isinstance(getattr(module, "linear_method", None), LinearMethod)]
    previous = [(layer.linear_method, layer.packed_weight) for layer in layers]
    for layer in layers:
        layer.linear_method = method
        method.process_weights(layer)
    try:
        yield
    finally:
        for layer, (own_method, packed) in zip(layers, previous, strict=True):
            layer.linear_method, layer.packed_weight = own_method, packed


def baseline(engine: ExecutionEngine, part: str) -> contextlib.AbstractContextManager:
    model = engine.worker.model
    if part == "fused":
        names = ("rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul")
        return swapped_ops(model, **{name: getattr(torch_ref, name) for name in names})
    if part == "prefill_attention":  # the per-request loop, decode still on its kernel
        return swapped_attention(model, ReferencePrefill(engine.worker.backend.attention))
    if part == "attention":  # decode through the gathered torch reference
        return swapped_attention(model, ReferenceAttention())
    return swapped_weights(model, OneDnnLinear() if part == "onednn" else PlainLinear())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--quantization", default="", help="model_config.quantization, e.g. w8a8 (default: none)")
    parser.add_argument("--model-path", type=Path, default=None, help="a model folder (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15, help="operators in the printed table")
    parts = ["attention", "weights", "onednn", "fused", "prefill_attention"]
    parser.add_argument("--baseline", default="attention", choices=parts, help="the part swapped for its baseline")
    parser.add_argument("--profile-baseline", action="store_true", help="profile decode with the baseline part")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = build_engine(args.dtype, args.batch_size, args.quantization, args.model_path)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        requests = prefilled(engine, args.batch_size, args.prompt_tokens)
        prefill_ms = (time.perf_counter() - start) * 1e3
    print(f"prefill of {args.batch_size} requests in one step: {prefill_ms:.0f} ms (profiled)")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.baseline == "prefill_attention":
        for request in requests:
            engine.kv_cache_manager.free(request)
        report = {"dtype": args.dtype, "batch_size": args.batch_size, "threads": torch.get_num_threads()}
        print(json.dumps(report | {"prompt_tokens": args.prompt_tokens, **prefill_timings(engine, args)}))
        return
    decode_ms(engine, requests, 2)  # warm

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with baseline(engine, args.baseline) if args.profile_baseline else contextlib.nullcontext():
            profiled_ms = decode_ms(engine, requests, args.steps)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))

    timings: dict[str, list[float]] = {"baseline": [], "built": []}
    for variant in ("baseline", "built", "built", "baseline"):
        with baseline(engine, args.baseline) if variant == "baseline" else contextlib.nullcontext():
            timings[variant] += decode_ms(engine, requests, args.steps)
    median = {variant: statistics.median(ms) for variant, ms in timings.items()}
    report = {
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "kv_tokens_per_request": requests[0].num_computed_tokens,
        "threads": torch.get_num_threads(),
        "profiled_ms_per_step": statistics.mean(profiled_ms),
        "decode_ms_per_step_median": median,
        "baseline": args.baseline,
        "baseline_over_built": median["baseline"] / median["built"],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
