"""The accuracy tools users run, EvalScope and lm-evaluation-harness, against the online server as they
are: each runs as its own process from its own virtualenv (scripts/setup_eval_tools.sh installs it),
on the small question files under dataset/eval/, with no hub. The commands are the ones
benchmarks/eval_accuracy.py runs for docs/accuracy.md's table, on a few items of each set.

Slow: about 3 minutes on two CPU cores once the tools are installed (the first set-up downloads
about 1.4 GB).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.eval_accuracy import (
    EVALSCOPE_DATASETS,
    ROOT,
    SETTINGS,
    EvalSize,
    Server,
    default_model_dir,
    evalscope_command,
    evalscope_scores,
    free_port,
    lm_eval_command,
    lm_eval_score,
    serve,
    setup_eval_tools,
    tool_env,
)

pytestmark = pytest.mark.slow

# A few items per set and short answers: the tools' paths, not the model's accuracy.
SIZE = EvalSize(limit=4, max_tokens=48, lm_eval_max_gen_toks=32, gsm8k_few_shot=0, concurrency=4)
TOOL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def venv() -> Path:
    return setup_eval_tools()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with serve(SETTINGS["fp32"], free_port(18100, 18199), log) as running:
        yield running


def successes(server: Server) -> float:
    """Requests the server finished (any finish reason), from GET /metrics."""
    return sum(v for k, v in server.metrics().items() if k.startswith("infer_recipes:request_success_total{"))


def run_tool(command: list[str], work_dir: Path) -> None:
    done = subprocess.run(command, cwd=ROOT, env=tool_env(), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    (work_dir / "tool.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (
        f"{Path(command[0]).name} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    )


def test_evalscope_scores_gsm8k_mcq_and_qa_files_through_the_chat_endpoint(venv, server, tmp_path):
    before = successes(server)
    run_tool(evalscope_command(venv, server.api_url, tmp_path, SIZE), tmp_path)

    scores = evalscope_scores(tmp_path)
    assert set(scores) == set(EVALSCOPE_DATASETS)
    for dataset, (metric, score) in scores.items():
        assert 0.0 <= score <= 1.0, (dataset, metric, score)
    # One chat completion per item, each counted in /metrics.
    assert successes(server) - before >= SIZE.limit * len(EVALSCOPE_DATASETS)


def test_lm_eval_loglikelihood_task_through_local_completions_with_echoed_logprobs(venv, server, tmp_path):
    before = successes(server)
    run_tool(lm_eval_command(venv, server.api_url, "infer_recipes_mcq", tmp_path, SIZE, default_model_dir()), tmp_path)

    metric, score = lm_eval_score(tmp_path, "infer_recipes_mcq")
    assert metric == "acc" and 0.0 <= score <= 1.0
    # The first items are easy for the model (fp32 picks every right answer by a wide margin): a
    # server whose echoed prompt logprobs were misaligned or wrong would score near chance (0.25).
    assert score >= 0.75, score
    # One request per choice (4 per question), each echoing its prompt with one token generated.
    assert successes(server) - before >= 4 * SIZE.limit


def test_lm_eval_generation_task_through_local_chat_completions(venv, server, tmp_path):
    before = successes(server)
    run_tool(
        lm_eval_command(venv, server.api_url, "infer_recipes_arith", tmp_path, SIZE, default_model_dir()), tmp_path
    )

    metric, score = lm_eval_score(tmp_path, "infer_recipes_arith")
    assert metric == "exact_match" and 0.0 <= score <= 1.0
    assert successes(server) - before >= SIZE.limit


def test_the_server_exits_0_on_sigterm_after_the_tools_ran(server):
    assert successes(server) > 0
    assert server.metrics()["infer_recipes:kv_cache_blocks_used"] == 0
    assert server.stop() == 0, server.log_path.read_text()[-3000:]
