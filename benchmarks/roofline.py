"""The decode step's roofline on this machine: how fast one step of a Llama-family model could be at
a given batch, from what the machine measures now, not from a datasheet.

It measures the memory read bandwidth (torch sum over 1 GiB), the matmul rate at a large square
shape and at each of the step's own shapes (`batch` rows against every projection and the LM head,
the best of MKL on the plain weight and the packed copy of ops/cpu.py), and prints one JSON line with
the bound each gives: bytes (weights plus the K/V read at `--kv-tokens` per request) over the
bandwidth, and FLOPs over the matmul rate. The roofline is the larger of the memory bound and the
compute bound at the step's own shapes; a decode step's time over it is what issue 12's "within 2.5x
of the roofline" measures.

`--scheme` sets the weights' form: the dtype's (default), a GGUF's Q4_1 blocks with a Q8_0 LM head
(`gguf`), W4A16 in groups of 64 with its LM head (`w4a16_g64`) or W8A8 with its LM head (`w8a8`). Bytes
are then what the CPU's kernels read (codes with their scales and offsets), the multiply-adds integer
ones where the scheme's kernel multiplies in integers (the GGUF's and W4A16's int8 rows up to 8 rows,
W8A8's int8 matmul), and the compute bound is the kernel's own rate at the step's shapes as well as
its rate with the weights in cache (`int8_gmacs_in_cache`: the integer rate the kernel reaches when
memory is not what it waits on).

    python benchmarks/roofline.py --batch-size 32 --kv-tokens 200 [--dtype bfloat16]
    python benchmarks/roofline.py --batch-size 1 --kv-tokens 150 --scheme gguf
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
from executor.types_.quant_scheme import GGUF_BLOCK_SCHEMES, GROUP, W8A8_INT8, WNA16, LinearScheme, QuantArgs
from module.linear import ColumnParallelLinear
from ops.backend import make_backend

# Bytes a weight reads in each scheme's kernel layout: (the layers' matrices, the LM head).
SCHEME_WEIGHT_BYTES = {
    "gguf": (20 / 32, 34 / 32),  # Q4_1: 16 bytes of codes, fp16 d and m per 32; Q8_0: 32 bytes and an fp16 d
    "w4a16_g64": (0.5 + 8 / 64, 0.5 + 8 / 64),  # int4 codes, fp32 scale and offset per 64
    "w8a8": (1.0, 1.0),  # int8 values (a scale per output channel)
}
# The scheme each layer's kernel runs (GGUF: the matrices' Q4_1; the Q8_0 head is timed as Q8_0 below).
SCHEMES = {
    "gguf": GGUF_BLOCK_SCHEMES["q4_1"],
    "w4a16_g64": LinearScheme(QuantArgs(4, strategy=GROUP, group_size=64)),
    "w8a8": LinearScheme(QuantArgs(8), QuantArgs(8, strategy="token", dynamic=True)),
}


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


def quantized_layer(in_features: int, out_features: int, scheme: LinearScheme) -> ColumnParallelLinear:
    """A layer of `scheme` as the CPU backend runs it (wna16_activations auto: a GGUF's int8 rows), its
    weights random: GGUF blocks as the loader gives them, the others rounded at load."""
    method = make_backend("cpu").linear_method(WNA16 if scheme.input_activations is None else W8A8_INT8)
    layer = ColumnParallelLinear(in_features, out_features, bias=False)
    gguf = scheme.weights.offset or scheme == GGUF_BLOCK_SCHEMES["q8_0"]
    layer.set_scheme(scheme, method, torch.float32, at_load=not gguf)
    blocks = (out_features, in_features // 32)
    if scheme.weights.offset:
        layer.weight.data = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
        layer.weight_offset.data = -torch.rand(blocks).half().float()
    elif gguf:
        layer.weight.data = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    else:
        layer.weight.data = torch.randn(out_features, in_features) * 0.05
    if gguf:
        layer.weight_scale.data = torch.rand(blocks).half().float() * 0.01
    method.process_weights(layer)
    return layer


def quantized_seconds(rows: int, in_features: int, out_features: int, scheme: LinearScheme, repeats: int = 10) -> float:
    """One call of `scheme`'s CPU kernel at `rows` rows."""
    layer = quantized_layer(in_features, out_features, scheme)
    x = torch.randn(rows, in_features)
    return best_seconds(lambda: layer(x), repeats)


def int8_gmacs_in_cache(rows: int, scheme: LinearScheme) -> float:
    """The scheme's kernel's multiply-adds per second with a weight that stays in the last-level cache
    (2048 x 1024: 1-2 MiB, large enough that the call's overhead is small beside it): its rate when
    memory is not what it waits on."""
    return rows * 2048 * 1024 / quantized_seconds(rows, 1024, 2048, scheme, repeats=100) / 1e9


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
    parser.add_argument("--scheme", default="", choices=["", *SCHEMES], help="quantized weights (fp32 activations)")
    args = parser.parse_args()
    dtype = torch.float32 if args.scheme else getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(args.model_path or default_model_path())
    element = torch.finfo(dtype).bits // 8
    shapes = step_shapes(config)
    layer_bytes, head_bytes = SCHEME_WEIGHT_BYTES.get(args.scheme, (element, element))
    weight_bytes = sum(
        i * o * calls * (head_bytes if i == shapes[-1][0] and o == shapes[-1][1] else layer_bytes)
        for i, o, calls in shapes
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * args.batch_size * args.kv_tokens * config.num_key_value_heads * head_dim * element
    kv_bytes *= config.num_hidden_layers
    flops = 2 * args.batch_size * sum(i * o * calls for i, o, calls in shapes)
    bandwidth = read_bandwidth_gb_per_s()
    square = 2048
    x = torch.randn(square, square, dtype=dtype)
    peak_gflops = 2 * square**3 / best_seconds(lambda: x @ x, 3) / 1e9
    if args.scheme:
        head_scheme = GGUF_BLOCK_SCHEMES["q8_0"] if args.scheme == "gguf" else SCHEMES[args.scheme]
        shape_s = sum(
            quantized_seconds(
                args.batch_size, i, o, head_scheme if (i, o, calls) == shapes[-1] else SCHEMES[args.scheme]
            )
            * calls
            for i, o, calls in shapes
        )
    else:
        shape_s = sum(matmul_seconds(args.batch_size, i, o, dtype) * calls for i, o, calls in shapes)
    memory_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
    report = {
        "batch_size": args.batch_size,
        "kv_tokens": args.kv_tokens,
        "dtype": args.dtype if not args.scheme else "float32 activations",
        "scheme": args.scheme or "none",
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
    if args.scheme:
        in_cache = int8_gmacs_in_cache(args.batch_size, SCHEMES[args.scheme])
        report["step_g_multiply_adds"] = flops / 2e9
        report["int8_gmacs_in_cache"] = in_cache
        report["compute_bound_ms_in_cache"] = flops / 2 / (in_cache * 1e9) * 1e3
    print(json.dumps(report))


if __name__ == "__main__":
    main()
