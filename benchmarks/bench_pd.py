"""Prefill-decode disaggregation against the combined server, on one machine.

PD: one prefill instance and one decode instance (`python -m executor.online --pd-role ...`), one
CPU core each (taskset, OMP_NUM_THREADS=1), behind the Router; combined: one server on both cores
(OMP_NUM_THREADS=2). Each is driven at each `--concurrency` by a closed-loop client (that many
streams at a time, `--num-prompts` requests of `--prompt-tokens` random token ids, greedy,
`--max-new-tokens` each with EOS ignored) through /v1/completions with `stream`: TTFT (the first
token's chunk) and TPOT ((last - first) / (tokens - 1)) p50 and p99, output tok/s. From the PD
instances' /stats: the KV transfer's bytes and seconds per request (prefill side: the send;
decode side: the receive) beside the prefill step's seconds per request (the prefill instance's
prefill steps' time over its requests), and their ratio (the issue's goal: under 10% at 1000-token
prompts).

    .venv/bin/python benchmarks/bench_pd.py                                    # SmolLM2-135M fp32, c 8 and 32
    .venv/bin/python benchmarks/bench_pd.py --yaml models/qwen3/config/tiny_random.yaml \\
        --prompt-tokens 64 --max-new-tokens 8 --concurrency 2 --num-prompts 4   # a tiny run (the test's)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (its server start / stop and CPU description)

# the decode side's wait for a KV includes the prefill instance's queue: at concurrency 32 of
# 1000-token prompts on one core that is minutes, past the 60 s default
TIMEOUT = ["--set", "disagg_config.transfer_timeout_s=1200"]
REPO = bench_serve.REPO
HOST = bench_serve.HOST


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml", default=bench_serve.DEFAULT_YAML)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--num-prompts", type=int, default=0, help="requests per run; 0 = 2 x concurrency")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cores", default="0,1", help="the two cores: PD puts one instance on each")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="section.key=value for every server"
    )
    parser.add_argument("--out", type=Path, default=None, help="write every figure here as JSON")
    return parser.parse_args(argv)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(int(round(q / 100 * (len(ordered) - 1))), len(ordered) - 1)
    return ordered[index]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            return {"error": f"status {answer.status_code}: {(await answer.aread())[:200]!r}"}
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            new = sum(len(choice.get("token_ids") or []) for choice in chunk["choices"])
            if new and first is None:
                first = time.perf_counter()
            tokens += new
    end = time.perf_counter()
    if first is None:
        return {"error": "no token came"}
    return {"ttft_s": first - start, "tpot_s": (end - first) / max(tokens - 1, 1), "tokens": tokens}


async def drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """A closed loop of `concurrency` streams over the prompts; the figures of the run."""
    queue = list(reversed(prompts))
    results: list[dict[str, Any]] = []
    timeout = httpx.Timeout(3600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:

        async def worker() -> None:
            while queue:
                results.append(await one_request(client, url, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - start
    good = [result for result in results if "error" not in result]
    ttft = [result["ttft_s"] * 1e3 for result in good]
    tpot = [result["tpot_s"] * 1e3 for result in good]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": [result["error"] for result in results if "error" in result][:3],
        "num_failed": len(results) - len(good),
        "output_tok_s": sum(result["tokens"] for result in good) / wall_s,
        "wall_s": wall_s,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
    }


def server_command(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "executor.online", "--yaml", args.yaml, "--port", str(port), *extra]
    for override in args.overrides:
        command += ["--set", override]
    return command


def pinned(command: list[str], cores: str) -> tuple[list[str], dict[str, str]]:
    """`command` on `cores` with as many torch threads."""
    threads = str(len(cores.split(",")))
    env = os.environ | {"OMP_NUM_THREADS": threads, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return ["taskset", "-c", cores, *command], env


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stats", timeout=30).json()


@contextmanager
def pd_servers(args: argparse.Namespace, logs: Path) -> Iterator[tuple[str, str, str]]:
    """(router URL, prefill URL, decode URL), each started and stopped."""
    taken: set[int] = set()
    prefill_core, decode_core = args.cores.split(",")[:2]
    ports = [bench_serve.free_port(taken) for _ in range(4)]
    prefill_port, decode_port, router_port, bootstrap_port = ports
    with ExitStack() as stack:
        extra = ["--pd-role", "prefill", "--set", f"disagg_config.bootstrap_port={bootstrap_port}", *TIMEOUT]
        command, env = pinned(server_command(args, prefill_port, *extra), prefill_core)
        stack.enter_context(
            bench_serve.running_server(
                "prefill", command, prefill_port, logs / "prefill.log", args.ready_timeout_s, env
            )
        )
        command, env = pinned(server_command(args, decode_port, "--pd-role", "decode", *TIMEOUT), decode_core)
        stack.enter_context(
            bench_serve.running_server("decode", command, decode_port, logs / "decode.log", args.ready_timeout_s, env)
        )
        prefill_url, decode_url = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
        router = [sys.executable, "-m", "executor.online.router", "--port", str(router_port)]
        router += ["--prefill", prefill_url, "--decode", decode_url]
        env = os.environ | {"PYTHONPATH": str(REPO)}
        stack.enter_context(bench_serve.running_server("router", router, router_port, logs / "router.log", 120, env))
        yield f"http://{HOST}:{router_port}", prefill_url, decode_url


def transfer_figures(
    before: dict[str, Any], after: dict[str, Any], decode_before: dict[str, Any], decode_after: dict[str, Any]
) -> dict[str, Any]:
    """Per request of one run: the KV bytes, the send and receive seconds, the prefill step seconds."""
    count = after["kv_transfers"] - before["kv_transfers"]
    if not count:
        return {"kv_transfers": 0}
    send_s = (after["kv_transfer_s"] - before["kv_transfer_s"]) / count
    prefilled = after["prefilled_requests"] - before["prefilled_requests"]
    prefill_s = (after["prefill_step_s"] - before["prefill_step_s"]) / max(prefilled, 1)
    receive_s = (decode_after["kv_transfer_s"] - decode_before["kv_transfer_s"]) / max(
        decode_after["kv_transfers"] - decode_before["kv_transfers"], 1
    )
    return {
        "kv_transfers": count,
        "kv_bytes_per_request": (after["kv_transfer_bytes"] - before["kv_transfer_bytes"]) / count,
        "send_ms_per_request": send_s * 1e3,
        "receive_ms_per_request": receive_s * 1e3,
        "prefill_step_ms_per_request": prefill_s * 1e3,
        "prefill_steps": after["prefill_steps"] - before["prefill_steps"],
        "transfer_share_of_prefill": max(send_s, receive_s) / prefill_s if prefill_s else None,
    }


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def vocab_size_of(yaml: str, overrides: list[str]) -> int:
    """The model's vocabulary, from its config.json (prompts are random ids below it)."""
    from executor.core.config import load_config
    from executor.offline.__main__ import resolve_model_path

    path = resolve_model_path(load_config(REPO / yaml if not Path(yaml).is_absolute() else yaml, overrides))
    config = json.loads((Path(path) / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| system | concurrency | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | KV / request | "
        "send / receive ms | prefill step ms per request | transfer / prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        transfer = row.get("transfer") or {}
        share = transfer.get("transfer_share_of_prefill")
        kv = f"{transfer['kv_bytes_per_request'] / 2**20:.1f} MiB" if transfer.get("kv_transfers") else ""
        lines.append(
            f"| {row['system']} | {row['concurrency']} | {row['output_tok_s']:.1f} | "
            f"{_num(row['ttft_ms_p50'])} / {_num(row['ttft_ms_p99'])} | {_num(row['tpot_ms_p50'])} / "
            f"{_num(row['tpot_ms_p99'])} | {kv} | "
            + (f"{transfer['send_ms_per_request']:.1f} / {transfer['receive_ms_per_request']:.1f}" if kv else "")
            + f" | {_num(transfer.get('prefill_step_ms_per_request'))} | "
            + (f"{share:.1%}" if share is not None else "")
            + " |"
        )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if len(args.cores.split(",")) != 2:
        print("error: --cores names two cores, e.g. 0,1", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="bench_pd_"))
    rows: list[dict[str, Any]] = []
    os.chdir(REPO)  # model_path in a YAML is relative to the repository
    vocab_size = min(vocab_size_of(args.yaml, args.overrides), 32000)
    prompts_for = {
        c: make_prompts(args.num_prompts or 2 * c, args.prompt_tokens, vocab_size, seed=c) for c in args.concurrency
    }
    with pd_servers(args, logs) as (router_url, prefill_url, decode_url):
        for concurrency in args.concurrency:
            before, decode_before = stats(prefill_url), stats(decode_url)
            row = asyncio.run(drive(router_url, prompts_for[concurrency], concurrency, args.max_new_tokens))
            row["transfer"] = transfer_figures(before, stats(prefill_url), decode_before, stats(decode_url))
            rows.append({"system": "PD (1 + 1 core)"} | row)
            print(format_table(rows[-1:]), flush=True)
    taken: set[int] = set()
    port = bench_serve.free_port(taken)
    command, env = pinned(server_command(args, port), args.cores)
    with bench_serve.running_server("combined", command, port, logs / "combined.log", args.ready_timeout_s, env):
        for concurrency in args.concurrency:
            row = asyncio.run(
                drive(f"http://{HOST}:{port}", prompts_for[concurrency], concurrency, args.max_new_tokens)
            )
            rows.append({"system": "combined (2 cores)"} | row)
            print(format_table(rows[-1:]), flush=True)
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": bench_serve.cpu_description(),
        "rows": rows,
    }
    print(format_table(rows))
    print(f"machine: {result['machine']}; logs in {logs}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    failed = sum(row["num_failed"] for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
