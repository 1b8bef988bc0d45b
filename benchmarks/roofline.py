"""The decode step's roofline on this machine: how fast one step of a Llama-family model could be at
a given batch, from what the machine measures now, not from a datasheet.

It measures the memory read bandwidth (torch sum over 1 GiB), the matmul rate at a large square
shape and at each of the step's own shapes (`batch` rows against every projection and the LM head,
the best of MKL on the plain weight and the packed copy of ops/cpu.py), and prints one JSON line with
the bound each gives: bytes (weights plus the K/V read at `--kv-tokens` per request) over the
bandwidth, and FLOPs over the matmul rate. The roofline is the larger of the memory bound and the
compute bound at the step's own shapes; a decode step's time over it is what issue 12's "within 2.5x
of the roofline" measures.

    python benchmarks/roofline.py --batch-size 32 --kv-tokens 200 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from executor.model_loader.default_model import default_model_path
from module.linear import ColumnParallelLinear
from ops.backend import make_backend


def best_seconds(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gb_per_s(gib: float = 1.0) -> float:
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    return data.numel() * 4 / best_seconds(data.sum, 5) / 1e9


def matmul_seconds(rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> float:
    """The faster of MKL on the plain weight and the CPU backend's packed copy (ops/cpu.py), for one call."""
    x = torch.randn(rows, in_features, dtype=dtype)
    method = make_backend("cpu", "eager", dtype).linear_method()
    layer = ColumnParallelLinear(in_features, out_features, linear_method=method)
    layer.weight.data = torch.randn(out_features, in_features, dtype=dtype)
    method.process_weights(layer)
    plain = best_seconds(lambda: F.linear(x, layer.weight), 10)
    return min(plain, best_seconds(lambda: method.apply(layer, x, None), 10))


def step_shapes(config: object) -> list[tuple[int, int, int]]:
    """(in, out, calls per step) of every projection of a Llama-family decoder step and its LM head."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [
        (hidden, q_size + 2 * kv_size, layers),
        (q_size, hidden, layers),
        (hidden, 2 * config.intermediate_size, layers),
        (config.intermediate_size, hidden, layers),
        (hidden, config.vocab_size, 1),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="HF model folder (default: the default model)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=200, help="K/V tokens each request reads per step")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(args.model_path or default_model_path())
    element = torch.finfo(dtype).bits // 8
    shapes = step_shapes(config)
    weight_bytes = sum(i * o * calls for i, o, calls in shapes) * element
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * args.batch_size * args.kv_tokens * config.num_key_value_heads * head_dim * element
    kv_bytes *= config.num_hidden_layers
    flops = 2 * args.batch_size * sum(i * o * calls for i, o, calls in shapes)
    bandwidth = read_bandwidth_gb_per_s()
    square = 2048
    x = torch.randn(square, square, dtype=dtype)
    peak_gflops = 2 * square**3 / best_seconds(lambda: x @ x, 3) / 1e9
    shape_s = sum(matmul_seconds(args.batch_size, i, o, dtype) * calls for i, o, calls in shapes)
    memory_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
    report = {
        "batch_size": args.batch_size,
        "kv_tokens": args.kv_tokens,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "read_gb_per_s": bandwidth,
        "matmul_gflops_square_2048": peak_gflops,
        "matmul_gflops_at_step_shapes": flops / shape_s / 1e9,
        "step_gflop": flops / 1e9,
        "step_mb_read": (weight_bytes + kv_bytes) / 1e6,
        "memory_bound_ms": memory_ms,
        "compute_bound_ms_at_peak": flops / (peak_gflops * 1e9) * 1e3,
        "compute_bound_ms_at_step_shapes": shape_s * 1e3,
        "roofline_ms": max(memory_ms, shape_s * 1e3),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
