"""Every linear weight of a decode step, at a few rows, through each fp32 CPU GEMM: how fast each
streams the weights when they come cold from memory, as in a real step (a loop over all of them,
540 MB for SmolLM2-135M, so none is in cache when its turn comes).

The kernels: MKL on the plain weight (`F.linear`, eager with prepack_weights off), MKL's packed GEMM
(`mkl::_mkl_linear`, what inductor's freezing and autotuning keep in a graph at 2 to 32 rows),
oneDNN's blocked layout, and this project's panels (ops/csrc/packed_linear.cpp, the CPU's widest).
Prints JSON: the best ms of --repeats passes over the weights, and GB/s of weights, per row count and kernel.

    python benchmarks/bench_linear_rows.py --rows 1 2 4 8 16 32
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None, help="default: the default model")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    weights = step_weights(args.model_path or Path(default_model_path()))
    gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
    report: dict = {"threads": torch.get_num_threads(), "weights_gb": round(gigabytes, 3), "by_rows": {}}
    for rows in args.rows:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        figures = {}
        for name, kernel in kernels(weights, rows).items():
            one_pass = functools.partial(every_weight, kernel, inputs, weights)
            seconds = best_seconds(one_pass, args.repeats)
            figures[name] = {"ms": round(seconds * 1e3, 2), "gb_per_s": round(gigabytes / seconds, 1)}
        report["by_rows"][rows] = figures
        print(rows, json.dumps(figures), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
