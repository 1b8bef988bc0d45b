"""Where a linear-attention model's eager step goes: torch.profiler over one prefill of a long prompt
and over decode steps of a batch, each recurrent op (ops/recurrent_ref.py, ops/kda.py) under a label
of its own, so that its share of the step is its inclusive CPU time over the step's.

The family's tiny random config measures per-layer overheads only; `--real` replaces its sizes with
the released model's per-layer ones (transformers' config defaults: Qwen3.5's hidden 4096, 16 key and
32 value heads of 128 for Gated DeltaNet; Kimi-Linear's hidden 2304, 32 KDA heads of 128, 8 of 16
experts of 1024), keeping 4 layers (3 linear-attention, 1 full) and the byte-level vocab, with random
weights. Prints JSON; docs/benchmarks.md records the figures.

    python benchmarks/profile_linear_attention.py --family qwen3_5 --real --batch-size 8 --prefill-tokens 512
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from bench_graph_modes import decode_ms
from profile_decode_step import swapped_ops
from torch.profiler import ProfilerActivity, profile, record_function

import models
from executor.core.config import build_config
from executor.core.engine.engine import ExecutionEngine
from executor.types_ import Request, SamplingParams
from ops.backend import RECURRENT_OPS

STEP = "step"
# The released models' per-layer sizes (transformers' config defaults), over the tiny config.json.
REAL_SIZES: dict[str, dict[str, object]] = {
    "qwen3_5": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "mtp_num_hidden_layers": 0,
    },
    "kimi_linear": {
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "qk_head_dim": 192,
        "head_dim": 64,
        "v_head_dim": 128,
        "linear_head_dim": 128,
        "linear_num_heads": 32,
        "num_experts": 16,
        "num_experts_per_token": 8,
    },
}
BLOCK_SIZE = 128
MAX_MODEL_LEN = 1024


def model_folder(family: str, real: bool, scratch: Path) -> Path:
    """The family's tiny random folder, or a copy whose config.json has the real per-layer sizes."""
    tiny = Path(models.__file__).parent / family / "tiny_random"
    if not real:
        return tiny
    folder = Path(shutil.copytree(tiny, scratch / family))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | REAL_SIZES[family], indent=2))
    return folder


def build_engine(family: str, folder: Path, batch_size: int) -> ExecutionEngine:
    config = build_config(
        {
            "model_config": {
                "model_name": family,
                "model_path": str(folder),
                "with_ckpt": False,
                "dtype": "float32",
                "device": "cpu",
            },
            "scheduler_config": {
                "batch_size": batch_size,
                "block_size": BLOCK_SIZE,
                "max_model_len": MAX_MODEL_LEN,
                "num_blocks": (batch_size + 1) * (MAX_MODEL_LEN // BLOCK_SIZE) + 1,
            },
        },
        source="profile_linear_attention",
    )
    engine = ExecutionEngine(config, str(folder))
    return engine


def labelled(model: torch.nn.Module) -> dict[str, object]:
    """The layers' recurrent ops, each run under a profiler label of its name."""
    record = next(m.ops for m in model.modules() if getattr(m, "ops", None) is not None)

    def label(name: str, op):  # noqa: ANN001, ANN202
        @functools.wraps(op)
        def run(*args: object, **kwargs: object) -> torch.Tensor:
            with record_function(name):
                return op(*args, **kwargs)

        return run

    return {name: label(name, getattr(record, name)) for name in RECURRENT_OPS if getattr(record, name) is not None}


def prefilled(engine: ExecutionEngine, num_tokens: int, request_id: str) -> Request:
    """One request of `num_tokens` prompt tokens (inside the byte-level vocab) prefilled in one step."""
    prompt = [(11 * position + len(request_id)) % 250 + 3 for position in range(num_tokens)]
    request = Request(request_id, None, prompt, SamplingParams(max_new_tokens=1 << 20))
    assert engine.kv_cache_manager.allocate_slots(request, request.num_tokens) is not None
    with record_function(STEP):
        (tokens,) = engine.runner.execute(
            engine.kv_cache_manager.batch([request], [request.num_tokens], is_prefill=True)
        ).new_token_ids
    request.num_computed_tokens = request.num_tokens
    request.output_token_ids.extend(tokens)
    return request


def shares(prof: profile, steps: int) -> dict[str, object]:
    """Per step: the step's CPU ms, each labelled op's ms and share of it, and the top aten ops by self time."""
    events = {event.key: event for event in prof.key_averages()}
    step_ms = events[STEP].cpu_time_total / 1e3 / steps
    ops = {
        name: {"ms": round(ms, 3), "share": round(ms / step_ms, 3)}
        for name in RECURRENT_OPS
        if name in events and (ms := events[name].cpu_time_total / 1e3 / steps)
    }
    aten = sorted((e for e in events.values() if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    top = {e.key: round(e.self_cpu_time_total / 1e3 / steps, 3) for e in aten[:6]}
    recurrent_ms = sum(op["ms"] for op in ops.values())
    return {
        "step_ms": round(step_ms, 3),
        "recurrent_share": round(recurrent_ms / step_ms, 3),
        "ops": ops,
        "top_aten_self_ms": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(REAL_SIZES))
    parser.add_argument("--real", action="store_true", help="the released model's per-layer sizes, 4 layers")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=3, help="profiled decode steps (after one unprofiled)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile-linear-") as scratch:
        folder = model_folder(args.family, args.real, Path(scratch))
        engine = build_engine(args.family, folder, args.batch_size)
    model = engine.worker.model
    with swapped_ops(model, **labelled(model)):
        engine.kv_cache_manager.free(prefilled(engine, 16, "warm"))  # first-call costs out of the profile
        with profile(activities=[ProfilerActivity.CPU]) as prefill_prof:
            engine.kv_cache_manager.free(prefilled(engine, args.prefill_tokens, "long"))
        requests = [prefilled(engine, 100 + index % 7, f"r{index}") for index in range(args.batch_size)]
        decode_ms(engine, requests, 1)
        with profile(activities=[ProfilerActivity.CPU]) as decode_prof:
            with record_function(STEP):
                step_ms = decode_ms(engine, requests, args.decode_steps)
    report = {
        "family": args.family,
        "sizes": "real per-layer" if args.real else "tiny",
        "threads": torch.get_num_threads(),
        f"prefill_{args.prefill_tokens}_tokens": shares(prefill_prof, 1),
        f"decode_batch_{args.batch_size}": shares(decode_prof, args.decode_steps)
        | {"wall_ms_median": round(statistics.median(step_ms), 3)},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
