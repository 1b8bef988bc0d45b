"""Every linear weight of a decode step, at a few rows, through each fp32 CPU GEMM: how fast each
streams the weights when they come cold from memory, as in a real step (a loop over all of them,
540 MB for SmolLM2-135M, so none is in cache when its turn comes).

The kernels: MKL on the plain weight (`F.linear`, eager with prepack_weights off), MKL's packed GEMM
(`mkl::_mkl_linear`, what inductor's freezing and autotuning keep in a graph at 2 to 32 rows),
oneDNN's blocked layout, and this project's panels (ops/csrc/packed_linear.cpp, the CPU's widest).
With `--quantized`, the same weights rounded as a GGUF holds them (4-bit codes with an fp16 scale and
minimum per 32 values, the LM head 8-bit with an fp16 scale per 32) through the few-row kernels
with fp32 rows (wna16_linear.cpp) and with int8 rows (q8_dot_linear.cpp; where the CPU has AVX-512 VNNI,
its AVX2 form too), and rounded to int8 per
channel through W8A8's AVX2 matmul (int16_madd_mm.cpp, its input int8 already).
Prints JSON: the best ms of --repeats passes over the weights, and GB/s of the bytes each kernel
reads, per row count and kernel.

    python benchmarks/bench_linear_rows.py --rows 1 2 4 8 16 32
    python benchmarks/bench_linear_rows.py --rows 1 32 --quantized
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from roofline import best_seconds
from safetensors.torch import load_file

from executor.model_loader.default_model import default_model_path
from ops import cpu_kernels
from ops.cpu import cpu_linear_method
from ops.cpu_quantized import VNNI_FLAGS

# Llama-style projections, fused as the model fuses them (models/llama/model.py).
FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def step_weights(model_path: Path) -> list[torch.Tensor]:
    """Each layer's fused projections in order, then the LM head (the tied embedding where no head)."""
    tensors = load_file(str(model_path / "model.safetensors"))
    layers = sorted({int(m.group(1)) for name in tensors if (m := re.match(r"model\.layers\.(\d+)\.", name))})
    weights = []
    for layer in layers:
        by_name = {
            name.rsplit(".", 2)[-2]: t for name, t in tensors.items() if name.startswith(f"model.layers.{layer}.")
        }
        weights += [torch.cat([by_name[part] for part in parts]).float().contiguous() for parts in FUSED]
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    return [*weights, head.float().contiguous()]


def every_weight(kernel: Callable[[torch.Tensor, int], torch.Tensor], inputs: dict, weights: list) -> None:
    """One pass over the step's weights, each times an input of its width."""
    for index, weight in enumerate(weights):
        kernel(inputs[weight.shape[1]], index)


def kernels(weights: list[torch.Tensor], rows: int) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Per kernel, a function of (x, weight index); layouts made here, outside the timing."""
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    found = {
        "mkl_plain": lambda x, i: F.linear(x, weights[i]),
        "mkl_packed": lambda x, i: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows),
        "onednn_blocked": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
    }
    method = cpu_linear_method(torch.float32, cpu_kernels.extension(), cpu_kernels.cpu_flags())
    if method is not None and method.layout == "panels":
        panels = [method.pack(w) for w in weights]
        found[f"panels_{method.width}"] = lambda x, i: torch.ops.infer_recipes.packed_linear(
            x, panels[i], None, weights[i].shape[0]
        )
    return found


def gguf_like(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsigned codes [N, K], fp16-exact scales and offsets [N, K / 32]) as a GGUF rounds `weight`:
    4-bit with a minimum per 32 values (Q4_1), 8-bit symmetric (Q8_0, as codes + 128)."""
    blocks = weight.reshape(weight.shape[0], -1, 32)
    if bits == 4:
        low, high = blocks.amin(-1), blocks.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8).half().float()
        offset = low.half().float()
        codes = ((blocks - offset[..., None]) / scale[..., None]).round().clamp(0, 15)
    else:
        scale = (blocks.abs().amax(-1) / 127).clamp(min=1e-8).half().float()
        offset = -128 * scale
        codes = (blocks / scale[..., None]).round().clamp(-127, 127) + 128
    return codes.reshape(weight.shape).to(torch.uint8), scale, offset


def quantized_kernels(
    weights: list[torch.Tensor],
) -> dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], int]]:
    """Per quantized kernel, a function of (x, weight index) and the bytes one pass reads."""
    ops = cpu_kernels.extension()
    coded = [gguf_like(w, 8 if i == len(weights) - 1 else 4) for i, w in enumerate(weights)]
    bits = [8 if i == len(weights) - 1 else 4 for i in range(len(weights))]
    wna16 = [ops.pack_wna16_weight(*c, b) for c, b in zip(coded, bits, strict=True)]
    q8 = [ops.pack_q8_dot_weight(*c, b) for c, b in zip(coded, bits, strict=True)]
    int8 = [
        ops.pack_int16_madd_weight((w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)) for w in weights
    ]
    found = {
        "gguf_fp32_rows": (
            lambda x, i: ops.wna16_linear(x, *wna16[i], None, bits[i], weights[i].shape[0]),
            sum(t.numel() * t.element_size() for packed in wna16 for t in packed),
        ),
        "gguf_int8_rows": (
            lambda x, i: ops.q8_dot_linear(x, *q8[i], None, bits[i], weights[i].shape[0]),
            sum(t.numel() * t.element_size() for packed in q8 for t in packed),
        ),
    }
    if VNNI_FLAGS <= cpu_kernels.cpu_flags():  # the AVX2 form beside the VNNI one the op takes here
        found["gguf_int8_rows_avx2_form"] = (
            lambda x, i: ops.q8_dot_linear(x, *q8[i], None, bits[i], weights[i].shape[0], 1),
            found["gguf_int8_rows"][1],
        )
    if "avx2" in cpu_kernels.cpu_flags():
        found["w8a8_int16_madd"] = (
            lambda x, i: ops.int16_madd_mm(x, int8[i], weights[i].shape[0]),
            sum(t.numel() * t.element_size() for t in int8),
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None, help="default: the default model")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quantized", action="store_true", help="the quantized few-row and int8 kernels too")
    args = parser.parse_args()
    weights = step_weights(args.model_path or Path(default_model_path()))
    gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
    report: dict = {"threads": torch.get_num_threads(), "weights_gb": round(gigabytes, 3), "by_rows": {}}
    for rows in args.rows:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        figures = {}
        timed = {name: (kernel, gigabytes * 1e9) for name, kernel in kernels(weights, rows).items()}
        if args.quantized:
            timed |= quantized_kernels(weights)
        int8_inputs = {k: (x * 20).round().clamp(-127, 127).to(torch.int8) for k, x in inputs.items()}
        for name, (kernel, kernel_bytes) in timed.items():
            given = int8_inputs if name.startswith("w8a8") else inputs
            one_pass = functools.partial(every_weight, kernel, given, weights)
            seconds = best_seconds(one_pass, args.repeats)
            figures[name] = {"ms": round(seconds * 1e3, 2), "gb_per_s": round(kernel_bytes / 1e9 / seconds, 1)}
        report["by_rows"][rows] = figures
        print(rows, json.dumps(figures), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
