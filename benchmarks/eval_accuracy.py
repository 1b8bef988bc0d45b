"""The default model's accuracy through the tools users run (EvalScope, lm-evaluation-harness) against
the online server, in several settings side by side (docs/accuracy.md).

    .venv/bin/python benchmarks/eval_accuracy.py                 # fp32, w8a8+c8, ge_graph+ngram
    .venv/bin/python benchmarks/eval_accuracy.py --settings fp32 --limit 5 --port 18150

For each setting it starts `python -m executor.online` with that setting's YAML and `--set`s, waits for
/health, runs EvalScope (gsm8k, general_mcq, general_qa on dataset/eval/) and lm-eval (a loglikelihood
task through `local-completions`, a generate_until task through `local-chat-completions`), stops the
server with SIGTERM, and prints one table: a row per dataset or task, a column per setting. The tools
come from their own virtualenv (scripts/setup_eval_tools.sh, run first). Every run's files stay under
--work-dir (EvalScope's reports/, lm-eval's results_*.json, each server's log).

tests/test_online_accuracy_tools.py runs the same commands (built here) on a few items of each set.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_DATA = ROOT / "dataset" / "eval"
LM_EVAL_TASKS = EVAL_DATA / "lm_eval"
SERVED_NAME = "smollm2"

# general_mcq's own default prompt is Chinese; this one is English, with one worked example so that a
# 135M model answers with a bare letter (EvalScope reads "ANSWER: X", else the reply's last capital).
MCQ_PROMPT = (
    "Answer the multiple choice question with the letter of the correct option.\n\n"
    "Question: What color is grass?\nA) Purple\nB) Green\nC) Orange\nD) Black\nANSWER: B\n\n"
    "Question: {question}\n{choices}\nANSWER:"
)


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    yaml: str  # relative to the repository root
    sets: tuple[str, ...] = ()  # --set section.key=value

    def server_args(self) -> list[str]:
        return ["--yaml", str(ROOT / self.yaml), *(arg for kv in self.sets for arg in ("--set", kv))]


SETTINGS = {
    setting.name: setting
    for setting in (
        Setting("fp32", "models/llama/config/smollm2_135m.yaml"),
        Setting("w8a8+c8", "models/llama/config/smollm2_135m.yaml", ("model_config.quantization=w8a8+c8",)),
        Setting(
            "ge_graph+ngram",
            "models/llama/config/smollm2_135m_ge_graph.yaml",
            (
                "speculative_config.method=ngram",
                "speculative_config.num_speculative_tokens=4",
                "speculative_config.prompt_lookup_min=2",
                "speculative_config.prompt_lookup_max=4",
            ),
        ),
    )
}


@dataclass(frozen=True)  # no slots: main() reads the defaults off the class
class EvalSize:
    """How much of each set a run takes and how long the model may answer."""

    limit: int | None = None  # items per EvalScope subset / lm-eval task; None: all
    max_tokens: int = 128  # EvalScope's generations
    lm_eval_max_gen_toks: int | None = None  # None: the task file's (48)
    gsm8k_few_shot: int = 3  # worked examples from gsm8k/train.jsonl
    concurrency: int = 8
    datasets: tuple[str, ...] = ("gsm8k", "general_mcq", "general_qa")  # EvalScope's; () skips it
    tasks: tuple[str, ...] = ("infer_recipes_mcq", "infer_recipes_arith")  # lm-eval's


# ---------------------------------------------------------------------------------------------------
# The tools' virtualenv and environment


def eval_venv() -> Path:
    home = Path(os.environ.get("INFER_RECIPES_HOME", Path.home() / ".cache" / "infer-recipes"))
    return Path(os.environ.get("EVAL_VENV", home / "eval-venv"))


def setup_eval_tools() -> Path:
    """Run scripts/setup_eval_tools.sh (quiet once installed); the virtualenv's folder."""
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_eval_tools.sh")], check=True)
    return eval_venv()


def tool_env() -> dict[str, str]:
    """The tools run with no hub access (lm-eval's `datasets` pings the network otherwise)."""
    return os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def default_model_dir() -> Path:
    """The default model's folder (its tokenizer is what lm-eval's loglikelihood requests need)."""
    sys.path.insert(0, str(ROOT))
    from executor.model_loader.default_model import ensure_default_model

    return ensure_default_model()


# ---------------------------------------------------------------------------------------------------
# The server


def free_port(first: int = 0, last: int = 0) -> int:
    """A port free on 127.0.0.1: the first free one in [first, last], or any when first is 0."""
    for port in range(first, last + 1) if first else [0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free port in {first}-{last}")


@dataclass(slots=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    process: subprocess.Popen
    log_path: Path
    exit_code: int | None = field(default=None)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def stop(self, timeout_s: float = 180) -> int:
        """SIGTERM (once), then wait; the exit status (killed after timeout_s: -9)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.exit_code = self.process.returncode
        return self.exit_code

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {sample name with labels: value}."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


@contextlib.contextmanager
def serve(
    setting: Setting,
    port: int,
    log_path: Path,
    *,
    python: str = sys.executable,
    served_model_name: str = SERVED_NAME,
    start_timeout_s: float = 1800,  # a first ge_graph start compiles 12 buckets: minutes each on 2 cores
    stop_timeout_s: float = 180,
) -> Iterator[Server]:
    """`python -m executor.online` in `setting` on `port`, ready (GET /health 200) when yielded;
    stopped with SIGTERM on exit, its exit status in `Server.exit_code`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [python, "-m", "executor.online", *setting.server_args(), "--port", str(port)]
    command += ["--served-model-name", served_model_name]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: {log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health in {start_timeout_s:.0f} s ({log_path})")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(server.base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            time.sleep(0.5)
        yield server
    finally:
        server.stop(stop_timeout_s)


# ---------------------------------------------------------------------------------------------------
# EvalScope

EVALSCOPE_DATASETS = EvalSize.datasets


def evalscope_command(venv: Path, api_url: str, work_dir: Path, size: EvalSize, model: str = SERVED_NAME) -> list[str]:
    """`evalscope eval` against an OpenAI server on dataset/eval/'s files (no hub)."""
    every_dataset_args = {
        "gsm8k": {
            "local_path": str(EVAL_DATA / "gsm8k"),
            "subset_list": ["default"],
            "few_shot_num": size.gsm8k_few_shot,
        },
        "general_mcq": {
            "local_path": str(EVAL_DATA / "mcq"),
            "subset_list": ["basics"],
            "prompt_template": MCQ_PROMPT,
        },
        "general_qa": {"local_path": str(EVAL_DATA / "qa"), "subset_list": ["basics"], "metric_list": ["Rouge"]},
    }
    dataset_args = {dataset: every_dataset_args[dataset] for dataset in size.datasets}
    command = [
        str(venv / "bin" / "evalscope"), "eval",
        "--model", model,
        "--api-url", api_url,
        "--api-key", "EMPTY",
        "--eval-type", "openai_api",
        "--datasets", *size.datasets,
        "--dataset-args", json.dumps(dataset_args),
        "--generation-config", json.dumps({"max_tokens": size.max_tokens, "temperature": 0.0}),
        "--eval-batch-size", str(size.concurrency),
        "--work-dir", str(work_dir),
        "--no-timestamp",
    ]  # fmt: skip
    if size.limit is not None:
        command += ["--limit", str(size.limit)]
    return command


def evalscope_scores(
    work_dir: Path, model: str = SERVED_NAME, datasets: tuple[str, ...] = EVALSCOPE_DATASETS
) -> dict[str, tuple[str, float]]:
    """{dataset: (metric, score)} from reports/<model>/<dataset>.json: each report's primary metric
    (gsm8k and general_mcq accuracy, general_qa ROUGE-L recall)."""
    scores = {}
    for dataset in datasets:
        report = json.loads((work_dir / "reports" / model / f"{dataset}.json").read_text())
        primary = report["primary_metric_identity"]
        (metric,) = [m for m in report["metrics"] if m["identity"] == primary]
        dims = primary["dimensions"]  # ROUGE's: variant l, statistic recall
        label = "-".join([primary["name"], *(str(dims[k]) for k in ("variant", "ngram", "statistic") if k in dims)])
        scores[dataset] = (label, float(metric["score"]))
    return scores


# ---------------------------------------------------------------------------------------------------
# lm-evaluation-harness

# task: (lm-eval model, endpoint, metric key in results_*.json)
LM_EVAL_TASKS_RUN = {
    "infer_recipes_mcq": ("local-completions", "completions", "acc,none"),
    "infer_recipes_arith": ("local-chat-completions", "chat/completions", "exact_match,last_number"),
}


def lm_eval_command(
    venv: Path, api_url: str, task: str, output_path: Path, size: EvalSize, tokenizer: Path, model: str = SERVED_NAME
) -> list[str]:
    """`lm_eval run` of one task file under dataset/eval/lm_eval (run from the repository root: the
    task files name their data relative to it). Loglikelihood through local-completions (with the
    model's tokenizer: lm-eval sends token ids), generate_until through local-chat-completions."""
    lm_model, endpoint, _ = LM_EVAL_TASKS_RUN[task]
    model_args = f"base_url={api_url}/{endpoint},model={model},num_concurrent={size.concurrency},max_retries=1"
    if lm_model == "local-completions":
        model_args += f",tokenizer_backend=huggingface,tokenizer={tokenizer}"
    command = [
        str(venv / "bin" / "lm_eval"), "run",
        "--model", lm_model,
        "--model_args", model_args,
        "--tasks", task,
        "--include_path", str(LM_EVAL_TASKS),
        "--output_path", str(output_path),
    ]  # fmt: skip
    if lm_model == "local-chat-completions":
        command.append("--apply_chat_template")
        if size.lm_eval_max_gen_toks is not None:
            command += ["--gen_kwargs", f"max_gen_toks={size.lm_eval_max_gen_toks}"]
    if size.limit is not None:
        command += ["--limit", str(size.limit)]
    return command


def lm_eval_score(output_path: Path, task: str) -> tuple[str, float]:
    """(metric, score) of `task` from the newest results_*.json under output_path."""
    results = sorted(glob.glob(str(output_path / "**" / "results_*.json"), recursive=True), key=os.path.getmtime)
    if not results:
        raise FileNotFoundError(f"no results_*.json under {output_path}")
    metric = LM_EVAL_TASKS_RUN[task][2]
    return metric.split(",")[0], float(json.loads(Path(results[-1]).read_text())["results"][task][metric])


# ---------------------------------------------------------------------------------------------------
# One setting, all tools


def run_tool(command: list[str], log_path: Path, timeout_s: float) -> None:
    with open(log_path, "w") as log:
        done = subprocess.run(
            command, cwd=ROOT, env=tool_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} exited {done.returncode}: {log_path.read_text()[-3000:]}")


def evaluate(
    api_url: str, work_dir: Path, size: EvalSize, venv: Path, tokenizer: Path, timeout_s: float = 1800
) -> dict[str, tuple[str, float]]:
    """Every dataset and task against a running server: {row name: (metric, score)}."""
    work_dir.mkdir(parents=True, exist_ok=True)
    scores: dict[str, tuple[str, float]] = {}
    if size.datasets:
        command = evalscope_command(venv, api_url, work_dir / "evalscope", size)
        run_tool(command, work_dir / "evalscope.log", timeout_s)
        for dataset, score in evalscope_scores(work_dir / "evalscope", datasets=size.datasets).items():
            scores[f"EvalScope {dataset}"] = score
    for task in size.tasks:
        lm_model = LM_EVAL_TASKS_RUN[task][0]
        out = work_dir / "lm_eval" / task
        run_tool(
            lm_eval_command(venv, api_url, task, out, size, tokenizer), work_dir / f"lm_eval_{task}.log", timeout_s
        )
        scores[f"lm-eval {task} ({lm_model})"] = lm_eval_score(out, task)
    return scores


def cpu_description() -> str:
    """lscpu's model name and the x86 flags that decide our CPU kernels' paths."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    shown = [f for f in wanted if f in flags]
    return f"{model}, {os.cpu_count()} CPUs; flags: {', '.join(shown) or 'none of ' + ', '.join(wanted)}"


def table(results: dict[str, dict[str, tuple[str, float]]]) -> str:
    settings = list(results)
    rows = list(dict.fromkeys(row for scores in results.values() for row in scores))
    lines = [
        "| dataset / task | metric | " + " | ".join(settings) + " |",
        "|---|---|" + "---:|" * len(settings),
    ]
    for row in rows:
        metric = next(scores[row][0] for scores in results.values() if row in scores)
        cells = [f"{results[s][row][1]:.3f}" if row in results[s] else "-" for s in settings]
        lines.append(f"| {row} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    parser.add_argument("--limit", type=int, default=None, help="items per dataset / task (default: all)")
    parser.add_argument("--max-tokens", type=int, default=EvalSize.max_tokens, help="EvalScope's max_tokens")
    parser.add_argument("--concurrency", type=int, default=EvalSize.concurrency)
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE", help="added to every setting"
    )
    parser.add_argument(
        "--datasets", nargs="*", default=list(EvalSize.datasets), choices=EvalSize.datasets, help="EvalScope's"
    )
    parser.add_argument("--tasks", nargs="*", default=list(EvalSize.tasks), choices=EvalSize.tasks, help="lm-eval's")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=ROOT / "models" / "llama" / "res" / time.strftime("%Y%m%d_%H%M%S_eval_accuracy"),
        help="where every run's files go (default: models/llama/res/<timestamp>_eval_accuracy, ignored by git)",
    )
    args = parser.parse_args(argv)

    venv = setup_eval_tools()
    tokenizer = default_model_dir()
    size = EvalSize(
        limit=args.limit,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        datasets=tuple(args.datasets),
        tasks=tuple(args.tasks),
    )
    results: dict[str, dict[str, tuple[str, float]]] = {}
    for name in args.settings:
        setting = SETTINGS[name]
        setting = Setting(setting.name, setting.yaml, (*setting.sets, *args.sets))
        work_dir = args.work_dir / name.replace("+", "_")
        print(f"[eval] {name}: {setting.yaml} {' '.join(setting.sets)}", file=sys.stderr, flush=True)
        started = time.monotonic()
        with serve(setting, args.port or free_port(), work_dir / "server.log") as server:
            results[name] = evaluate(server.api_url, work_dir, size, venv, tokenizer)
        if server.exit_code != 0:
            print(f"[eval] {name}: the server exited {server.exit_code} on SIGTERM", file=sys.stderr)
        print(f"[eval] {name}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        (args.work_dir / "scores.json").write_text(json.dumps(results, indent=1))
    print(f"CPU: {cpu_description()}")
    print(table(results))
    print(f"files: {args.work_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
