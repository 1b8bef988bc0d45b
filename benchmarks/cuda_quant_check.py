"""The GPU check of the CUDA record's quantized linears, prepared for a lent device (issue 20).

1. Parity on tiny random models (a few linear layers with SiLU between, quantized at load by
   ops/quant_math.py's round-to-nearest): W8A8 int8 (Int8ScaledLinear over padded torch._int_mm),
   FP8 per channel with per-token activations and FP8 per tensor (Fp8ScaledLinear over
   torch._scaled_mm, rowwise and tensorwise), each against the plain reference (weights
   dequantized, activations fake-quantized, a float32 matmul); fails above `--tolerance` (relative
   to the largest output).
2. A micro-benchmark at decode and prefill row counts: bf16 F.linear against torch._int_mm (int8,
   rows padded to 17) and torch._scaled_mm (fp8 rowwise), median milliseconds and TFLOP/s.

Needs only torch and this repository's ops/ (no compressed-tensors, gguf or transformers), so it
runs on the GPU image's torch 2.11. `--device cpu` runs both parts on the CPU (small shapes), which
torch 2.13's CPU build allows.

    python benchmarks/cuda_quant_check.py [--device cuda|cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.types_.quant_scheme import CHANNEL, FLOAT, INT, TENSOR, TOKEN, LinearScheme, QuantArgs  # noqa: E402
from ops import cuda_quant, quant_math  # noqa: E402
from ops.linear_method import PLAIN, LinearMethod  # noqa: E402
from ops.quantized_linear import DequantizedLinear, Int8ScaledLinear  # noqa: E402

SCHEMES = {
    "w8a8_int8": LinearScheme(QuantArgs(8, INT, CHANNEL), QuantArgs(8, INT, TOKEN, dynamic=True)),
    "fp8_channel": LinearScheme(QuantArgs(8, FLOAT, CHANNEL), QuantArgs(8, FLOAT, TOKEN, dynamic=True)),
    "fp8_tensor": LinearScheme(QuantArgs(8, FLOAT, TENSOR), QuantArgs(8, FLOAT, TENSOR)),
}


class TinyLinear(nn.Module):
    """What a linear method reads of a layer quantized at load: its float weight, bias and scheme."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, scheme: LinearScheme, method: LinearMethod) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.scheme, self.linear_method = scheme, method
        self.compute_dtype, self.quantize_at_load = weight.dtype, True
        method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


def method_for(name: str) -> LinearMethod:
    if name == "w8a8_int8":
        return Int8ScaledLinear(cuda_quant.padded_int_mm, "torch._int_mm, rows padded to 17")
    return cuda_quant.Fp8ScaledLinear(DequantizedLinear(PLAIN, "refused"))


def reference_linear(weight: torch.Tensor, bias: torch.Tensor, scheme: LinearScheme, x: torch.Tensor):
    """One layer by quant_math in float32: the weight rounded to nearest and dequantized, x fake-quantized."""
    args = scheme.weights
    dense = quant_math.dequantize_weight(*quant_math.quantize_weight(weight, args), args, torch.float32)
    return F.linear(quant_math.fake_quantize_activation(x.float(), scheme.input_activations), dense, bias.float())


def parity(name: str, device: torch.device, dtype: torch.dtype, sizes: list[int], rows: int) -> dict[str, object]:
    """Ours against the reference on a random stack of linears of widths `sizes`, layer by layer: each
    layer's reference takes our previous layer's output, since one bf16 rounding apart is enough to
    move an fp8 value by a step (e4m3 steps are 6 to 12%) and chained errors would measure that."""
    generator = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(out_f, in_f, generator=generator) / in_f**0.5, torch.randn(out_f, generator=generator) * 0.1)
        for in_f, out_f in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    scheme = SCHEMES[name]
    layers = [TinyLinear(w.to(device, dtype), b.to(device, dtype), scheme, method_for(name)) for w, b in weights]
    x = torch.randn(rows, sizes[0], generator=generator).to(device, dtype)
    errors = []
    with torch.inference_mode():
        for index, layer in enumerate(layers):
            out = layer(x)
            expected = reference_linear(layer.weight.float(), layer.bias, scheme, x)  # the bf16 weight, as ours
            errors.append(((out.float() - expected).abs().max() / expected.abs().max()).item())
            x = F.silu(out) if index < len(layers) - 1 else out
    error = max(errors)
    return {"scheme": name, "rows": rows, "sizes": sizes, "max_relative_error": error,
            "how": layers[0].linear_method.describe(layers[0])}  # fmt: skip


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def micro_benchmark(device: torch.device, rows: int, features: int, repeats: int) -> dict[str, object]:
    """bf16 F.linear against the int8 and fp8 matmuls at [rows, K] x [K, N], K = N = `features`."""
    x = torch.randn(rows, features, device=device, dtype=torch.bfloat16)
    weight = torch.randn(features, features, device=device, dtype=torch.bfloat16)
    x_int8, x_scale = quant_math.quantize_int8_per_token(x)
    w_int8_t = torch.randint(-128, 128, (features, features), device=device, dtype=torch.int8).t().contiguous()
    x_fp8 = x.to(torch.float8_e4m3fn)
    w_fp8_t = weight.to(torch.float8_e4m3fn).t()  # column-major, as torch._scaled_mm wants
    ones_x = torch.ones(rows, 1, device=device)
    ones_w = torch.ones(1, features, device=device)
    kernels = {
        "bf16 F.linear": lambda: F.linear(x, weight),
        "int8 torch._int_mm": lambda: cuda_quant.padded_int_mm(x_int8, w_int8_t).float() * x_scale,
        "fp8 torch._scaled_mm rowwise": lambda: torch._scaled_mm(
            x_fp8, w_fp8_t, ones_x, ones_w, out_dtype=torch.bfloat16
        ),
    }
    flops = 2 * rows * features * features
    results = {}
    for name, fn in kernels.items():
        try:
            ms = median_ms(fn, device, repeats)
            results[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 3)}
        except RuntimeError as error:  # a kernel the device lacks: said, not fatal
            results[name] = {"error": str(error).splitlines()[0]}
    return {"rows": rows, "features": features, **results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    capability = cuda_quant.device_capability() if on_gpu else None
    report: dict[str, object] = {"torch": torch.__version__, "device": str(device), "capability": capability}
    if on_gpu:
        report["gpu"] = torch.cuda.get_device_name(device)
    sizes = [512, 1024, 1024, 512] if on_gpu else [64, 96, 80, 64]
    report["parity"] = [parity(name, device, torch.bfloat16, sizes, rows) for name in SCHEMES for rows in (1, 5, 40)]
    shapes = [(1, 4096), (16, 4096), (128, 4096), (2048, 4096)] if on_gpu else [(1, 512), (32, 512)]
    report["micro_benchmark"] = [
        micro_benchmark(device, rows, features, 50 if on_gpu else 5) for rows, features in shapes
    ]
    print(json.dumps(report, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    failed = [entry for entry in report["parity"] if entry["max_relative_error"] > args.tolerance]
    for entry in failed:
        print(
            f"FAILED parity: {entry['scheme']} rows {entry['rows']}: {entry['max_relative_error']:.4f}", file=sys.stderr
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
