"""Speculative decoding against plain greedy decoding on the same prompts, in one process.

For each batch size, runs the engine with speculation off and with each method, in the order off,
methods, methods reversed, off (drift cancels), greedy with EOS ignored (with --stop-at-eos each
request ends at its EOS), and prints JSON: decode output tokens per second of each run, its speed-up
over speculation off, and the accept figures (accept rate, mean accept length, equivalent per-token
decode time). Greedy outputs are checked equal to speculation off's. docs/benchmarks.md records the
figures.

    python benchmarks/bench_spec_decode.py --methods ngram --dataset repeat_input --batch-sizes 1 8
    python benchmarks/bench_spec_decode.py --methods mtp draft_model --batch-sizes 1 8
    python benchmarks/bench_spec_decode.py --methods eagle3 mtp ngram --batch-sizes 1 8 --exe-mode ge_graph
    python benchmarks/bench_spec_decode.py --methods eagle3:w8a16_g32+lm_head eagle3+lookup:w8a16_g32+lm_head \
        --batch-sizes 1 --num-prompts 0 --exe-mode ge_graph --num-speculative-tokens 2
    python benchmarks/bench_spec_decode.py --methods ngram --dataset repeat_input --batch-sizes 1 \
        --exe-mode ge_graph --graph-buckets 1 --rounds 3

In a graph mode each engine is built once per batch size and run again in every round (its graphs,
verify buckets included, compiled once), with the one graph bucket of its batch size unless
--graph-buckets says others; `graph` in the output says which steps ran in them.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
from pathlib import Path

import torch
from bench_vs_transformers import add_engine_args, build_inference, load_records, run_ours

from executor.model_loader.default_model import default_model_path

METHODS = ("ngram", "mtp", "draft_model", "eagle3")


def parse_run(run: str) -> tuple[str, bool, str]:
    """A --methods entry, METHOD[+lookup][:SCHEMES] -> (method, prompt lookup in front, drafter schemes)."""
    name, _, quantization = run.partition(":")
    method, plus, suffix = name.partition("+")
    if method not in METHODS or (plus and suffix != "lookup"):
        raise ValueError(f"--methods: {run} is not METHOD[+lookup][:SCHEMES] with a method of {', '.join(METHODS)}")
    return method, bool(plus), quantization


def sections_for(run: str, args: argparse.Namespace) -> dict:
    """The YAML sections of one run: "off", a method, METHOD:SCHEMES (its drafter quantized at load
    by speculative_config.quantization, e.g. eagle3:w8a16_g32+lm_head), METHOD+lookup (prompt lookup
    in front of its drafter: speculative_config.prompt_lookup) or both (eagle3+lookup:w8a16_g32+lm_head)."""
    if run == "off":
        return {}
    method, lookup, quantization = parse_run(run)
    spec = {
        "method": method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "quantization": quantization,
        "prompt_lookup": lookup,
    }
    if method == "draft_model":
        spec["draft_model_path"] = str(args.draft_model_path)
    if method == "eagle3":
        spec["draft_model_path"] = str(args.eagle3_path)
    if method == "ngram" or lookup:
        spec |= {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return {"speculative_config": spec}


def first_difference(expected: list[list[int]], actual: list[list[int]]) -> dict | None:
    """Where `actual` first leaves `expected` (the request, the output token) and how many requests
    differ; None where they are equal. In bf16 a verify step's rows go through other kernels than a
    one-row decode step's, so a near-tie can flip (docs/speculative_decoding.md)."""
    differing = [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]
    if not differing:
        return None
    first = differing[0]
    pairs = zip(expected[first], actual[first], strict=False)
    token = next((j for j, (e, a) in enumerate(pairs) if e != a), min(len(expected[first]), len(actual[first])))
    return {"requests": len(differing), "of": len(expected), "request": first, "token": token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, num_prompts=16, batch_size=8, block_size=16, max_new_tokens=64, num_blocks=0)
    parser.add_argument("--dataset", default="default")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["ngram"],
        help=f"each one of {', '.join(METHODS)}; METHOD:SCHEMES for a drafter quantized at load (eagle3, "
        "draft_model: speculative_config.quantization, e.g. eagle3:w8a16_g32+lm_head); METHOD+lookup for prompt "
        "lookup in front of its drafter (mtp, eagle3: speculative_config.prompt_lookup), e.g. "
        "eagle3+lookup:w8a16_g32+lm_head",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft-model-path", type=Path, default=None, help="default: <model>-draft8 beside it")
    parser.add_argument("--mtp-model-path", type=Path, default=None, help="default: <model>-MTP beside it")
    parser.add_argument("--eagle3-path", type=Path, default=None, help="default: <model>-EAGLE3 beside it")
    parser.add_argument("--rounds", type=int, default=1, help="times the order off, methods, reversed, off is run")
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each request at its EOS, as a run does (default: --max-new-tokens each, past EOS, so that every "
        "method decodes the same token count; what a model writes past its EOS is no part of the task)",
    )
    args = parser.parse_args()
    for run in args.methods:
        try:
            parse_run(run)
        except ValueError as error:
            parser.error(str(error))
    logging.basicConfig(level=logging.WARNING)
    base_model = Path(args.model_path or default_model_path())
    args.draft_model_path = args.draft_model_path or base_model.with_name(f"{base_model.name}-draft8")
    args.eagle3_path = args.eagle3_path or base_model.with_name(f"{base_model.name}-EAGLE3")
    records = load_records(args.dataset, args.num_prompts)
    report: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "dtype": args.dtype,
        "dataset": args.dataset,
        "prompts": len(records),
        "max_new_tokens": args.max_new_tokens,
        "stop_at_eos": args.stop_at_eos,
        "num_speculative_tokens": args.num_speculative_tokens,
        "exe_mode": args.exe_mode,
        "by_batch_size": {},
    }
    buckets = args.graph_buckets
    for batch_size in args.batch_sizes:
        args.batch_size = batch_size
        args.graph_buckets = buckets or [batch_size]  # graph modes: the batch's own bucket unless told
        runs: dict[str, list[dict]] = {}
        outputs: dict[str, list[list[int]]] = {}  # each method's first run's tokens, per request
        engines: dict = {}  # graph modes: one engine per method, run in every round
        for method in ["off", *args.methods, *reversed(args.methods), "off"] * args.rounds:
            # MTP needs the model folder that holds the trained MTP head (scripts/train_mtp_head.py)
            args.model_path = (
                (args.mtp_model_path or base_model.with_name(f"{base_model.name}-MTP"))
                if method != "off" and parse_run(method)[0] == "mtp"
                else base_model
            )
            sections = sections_for(method, args)
            scheduler = {"ignore_eos": not args.stop_at_eos}
            if args.exe_mode != "eager" and method not in engines:
                engines[method] = build_inference(args, 1024, scheduler, sections)
            tokens: list[list[int]] = []
            figures, _ = run_ours(
                args, records, 1024, scheduler, sections, outputs=tokens, inference=engines.get(method)
            )
            runs.setdefault(method, []).append(figures)
            outputs.setdefault(method, tokens)
        off = statistics.fmean(f["decode_output_tokens_per_s"] for f in runs["off"])
        report["by_batch_size"][batch_size] = {
            method: {
                "decode_output_tokens_per_s": statistics.fmean(f["decode_output_tokens_per_s"] for f in figures),
                "speedup_over_off": statistics.fmean(f["decode_output_tokens_per_s"] for f in figures) / off,
                "speculative": figures[0]["speculative"],
                "outputs_equal_to_off": figures[0]["outputs_sha256"] == runs["off"][0]["outputs_sha256"],
                "first_difference_from_off": first_difference(outputs["off"], outputs[method]),
                "graph": figures[-1]["graph"],
            }
            for method, figures in runs.items()
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
