"""Where the online server's time goes, against the offline loop on the same engine, by timings.

One process, one engine: the offline loop runs the dataset at the YAML's batch size first (and
again last, to bracket the machine's load on a shared machine); between, the same ExecutionEngine
is served as `python -m executor.online` serves it (EngineLoop, OnlineServer, uvicorn, on a thread
here) and vLLM's load generator (benchmarks/vllm_bench_client.py) drives it at one concurrency.
Every core step is timed from the engine loop's thread (the step itself, and the gap before the
next while requests were in flight), and the CPU seconds of each thread of this process
(the engine loop, the HTTP event loop, torch's OpenMP workers) and of the load generator are read
from /proc around each part. Prints one JSON object; nothing of the server is changed.

    .venv/bin/python benchmarks/profile_serve.py --concurrency 32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by native id, with its name."""
    ticks = os.sysconf("SC_CLK_TCK")
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tid = int(task.name)
        # fields after the name: state is [0]; utime [11], stime [12]
        out[tid] = (names.get(tid, "native (torch/OpenMP or runtime)"), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def cpu_by_name(before: dict, after: dict) -> dict[str, float]:
    totals: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        totals[name] = totals.get(name, 0.0) + seconds - before.get(tid, (name, 0.0))[1]
    return {name: round(seconds, 2) for name, seconds in sorted(totals.items(), key=lambda item: -item[1])}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def step_figures(records: list[Any], batch_size: int) -> dict[str, Any]:
    decode = [r for r in records if r.phase == "decode"]
    full = [r.step_time_ms for r in decode if r.batch_size == batch_size]
    parts: dict[str, list[float]] = {}
    for record in decode:
        for part, ms in (record.parts_ms or {}).items():
            parts.setdefault(part, []).append(ms)
    return {
        "steps": len(records),
        "prefill_steps": len(records) - len(decode),
        "step_ms_total": round(sum(r.step_time_ms for r in records), 1),
        "decode_ms_mean": round(statistics.fmean(r.step_time_ms for r in decode), 2) if decode else None,
        f"decode_ms_mean_at_batch_{batch_size}": round(statistics.fmean(full), 2) if full else None,
        "decode_steps_at_full_batch": len(full),
        "decode_batch_mean": round(statistics.fmean(r.batch_size for r in decode), 2) if decode else None,
        "decode_parts_ms_mean": {part: round(statistics.fmean(ms), 2) for part, ms in parts.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml", default=bench_serve.DEFAULT_YAML)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--dataset", default="chat64")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", default=bench_serve.default_vllm_python())
    parser.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/profile_serve"))
    args = parser.parse_args()
    args.num_prompts_c1 = args.num_prompts
    args.work_dir.mkdir(parents=True, exist_ok=True)

    import uvicorn
    from bench_vs_transformers import load_records
    from transformers import AutoTokenizer

    from executor.core.sampler import default_sampling_params
    from executor.offline.__main__ import check_model_config
    from executor.offline.offline_inference import OfflineInference
    from executor.online.engine_loop import EngineLoop
    from executor.online.server import OnlineServer, ServerSettings

    checked = check_model_config(args.yaml, bench_serve.offline_overrides(args, "float32"))
    model_path = str(checked.model_path)
    batch_size = checked.config.scheduler_config.batch_size
    records = load_records(args.dataset, 0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts = [bench_serve.chat_text(record, tokenizer) for record in records]
    prompt_file = bench_serve.write_prompt_file(texts, args.work_dir / "prompts.jsonl", args.max_new_tokens)
    report: dict[str, Any] = {}

    # -- offline, on this engine (before and after the served run, to bracket the machine's load) ---
    inference = OfflineInference(checked.config, model_path)
    engine = inference.engine
    chosen = records[: args.num_prompts]

    def offline(key: str) -> None:
        cpu0, wall0 = thread_cpu_s(), time.perf_counter()
        result = inference.generate(chosen)
        wall = time.perf_counter() - wall0
        report[key] = {
            "wall_s": round(wall, 2),
            "output_tok_s": round(result.summary["output_tokens"] / wall, 1),
            **step_figures(result.steps, batch_size),
            "thread_cpu_s": cpu_by_name(cpu0, thread_cpu_s()),
            "load": os.getloadavg(),
        }
        print(json.dumps({key: report[key]}), flush=True)

    offline("offline")

    # -- the same engine, served -------------------------------------------------------------
    loop = EngineLoop(engine, max_waiting_requests=512)
    core_step = loop.core.step
    timings: list[tuple[float, float, Any]] = []

    def timed_step():
        start = time.perf_counter()
        step = core_step()
        timings.append((start, time.perf_counter(), step.record))
        return step

    loop.core.step = timed_step  # an attribute of this instance only
    settings = ServerSettings(
        ["default"], engine.max_model_len, engine.vocab_size, default_sampling_params(engine.config)
    )
    server = OnlineServer(loop, engine.tokenizer, settings)
    port = bench_serve.free_port(set())
    http = uvicorn.Server(
        uvicorn.Config(server.app, host=bench_serve.HOST, port=port, log_level="warning", lifespan="off")
    )
    http_thread = threading.Thread(target=http.run, name="http (uvicorn event loop)", daemon=True)
    loop.start()
    http_thread.start()
    while not bench_serve.http_ok(f"http://{bench_serve.HOST}:{port}/health"):
        time.sleep(0.2)
    command = bench_serve.load_command(args, port, model_path, prompt_file, args.concurrency, "profile")
    cpu0, child0, wall0 = thread_cpu_s(), children_cpu_s(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - wall0
    cpu1, child1 = thread_cpu_s(), children_cpu_s()
    http.should_exit = True
    loop.stop(timeout_s=30)
    http_thread.join(30)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
        return 1
    load = bench_serve.figures_from_load(
        bench_serve.parse_load_output(done.stdout), args.concurrency, args.max_new_tokens
    )
    # the load generator sends one test request first: the timed run is the last num_prompts requests' steps
    steps = [t for t in timings if t[2] is not None]
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    served_records = [record for _, _, record in steps]
    span = steps[-1][1] - steps[0][0] if steps else 0.0
    report["served"] = {
        "load_generator": load,
        "wall_s": round(wall, 2),
        **step_figures(served_records, batch_size),
        "steps_span_s": round(span, 2),
        "between_steps_s_total": round(sum(gaps), 2),
        "between_steps_ms_p50": round(statistics.median(gaps) * 1e3, 2) if gaps else None,
        "between_steps_ms_p99": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3, 2) if gaps else None,
        "thread_cpu_s": cpu_by_name(cpu0, cpu1),
        "load_generator_cpu_s": round(child1 - child0, 2),
    }
    report["served"]["load"] = os.getloadavg()
    offline("offline_after")
    print(json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
