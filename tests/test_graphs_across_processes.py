"""Graph modes under torchrun on CPU (gloo): the decode steps run in graphs whose collectives are
c10d's functional ones, and greedy outputs equal the one-process eager run token for token.

Each run compiles for real, in every process, so the cases are few and small: one bucket each, the
tiny DeepSeek-V3 at attention TP 2 with EP 2 (inside one replica), it and the tiny Qwen3-MoE at DP 2 x EP 2
(lock-step, one replica idle for its last steps, its idle forwards served by the same graph as the
other's decode steps). Logits move by rounding (the row-parallel sums' order, inductor's C++
GEMMs): logprobs are held to the distributed tests' bound. The CPU's npugraph_ex is refused above
one process (test_distributed.py).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import (
    DistRun,
    max_logprob_difference,
    parallel_overrides,
    run_distributed,
    run_one_process,
    token_ids,
)
from tests.run_harness import summary, write_run
from tests.test_distributed import (
    FP32_REORDER_BOUND,
    LOGPROBS,
    UNEVEN,
    assert_lock_step_equals_one_process,
    assert_ran,
    save_moe_folder,
    write_uneven_run,
)

pytestmark = pytest.mark.slow  # every test compiles graphs in several processes

GE_GRAPH = "model_config.exe_mode=ge_graph"


def one_bucket(rows: int) -> str:
    return f"scheduler_config.graph_buckets=[{rows}]"


def graph_stats(run: DistRun) -> list[dict]:
    """Each DP replica's `graph` summary (one entry without DP)."""
    part = summary(run.out)["parts"][-1]
    return [replica["graph"] for replica in part.get("data_parallel_replicas", [part])]


def assert_tp_run_equals_one_process(run: DistRun, reference: dict[str, dict]) -> None:
    """Same tokens, logprobs within rounding, and every decode step in the one bucket's graph."""
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    decode_steps = sum(step["phase"] == "decode" for step in run.steps())
    (graph,) = graph_stats(run)
    assert graph["graph_steps_per_bucket"] == {str(graph["buckets"][0]): decode_steps}
    assert graph["eager_steps"] == len(run.steps()) - decode_steps  # the prefills


def test_ge_graph_at_attention_tp_2_with_ep_2_gives_one_process_tokens(tmp_path):
    """The attention all-reduces and the experts' combine over moe_ep inside the compiled graph."""
    family = "deepseek_v3"
    model_dir = save_moe_folder(tmp_path / "model", family)
    run_yaml = write_run(tmp_path, model_dir, num_prompts=4)
    name = f"model_config.model_name={family}"
    reference = run_one_process(run_yaml, tmp_path / "one_process", name, LOGPROBS)
    sizes = dict(attn_tp_size=2, moe_tp_size=1)  # EP = world_size / moe_tp_size = 2
    overrides = [name, LOGPROBS, GE_GRAPH, one_bucket(3), *parallel_overrides(2, **sizes)]
    run = run_distributed(run_yaml, tmp_path / "tp2ep2", overrides)
    assert_tp_run_equals_one_process(run, reference)
    assert "moe_ep.all_reduce" in run.steps()[0]["comm_bytes"]  # the eager prefill counts its bytes
    assert run.steps()[-1]["comm_bytes"] == {}  # a graph step runs no Python that could count them


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("qwen3_moe", marks=pytest.mark.long)])
def test_ge_graph_lock_step_dp_2_by_ep_2_serves_idle_forwards_through_the_same_graph(family, tmp_path):
    """Replica 0 serves r0 (2 tokens) then r2 (4), replica 1 r1 (8), one request at a time. 8 world
    steps: both prefill (eager); both decode (graph); replica 0 prefills r2 while replica 1 decodes,
    so both run that step eagerly; both decode three times; replica 0, out of work, runs 2 idle
    forwards through bucket 1's graph beside replica 1's decode steps."""
    model_dir = save_moe_folder(tmp_path / "model", family)
    run_yaml = write_uneven_run(tmp_path, model_dir)
    name = f"model_config.model_name={family}"
    reference = run_one_process(run_yaml, tmp_path / "one_process", name, *UNEVEN)
    sizes = dict(attn_tp_size=1, moe_tp_size=1)  # DP 2, EP 2
    overrides = [name, *UNEVEN, GE_GRAPH, one_bucket(1), *parallel_overrides(2, **sizes)]
    run = run_distributed(run_yaml, tmp_path / "dp2ep2", overrides)
    assert_lock_step_equals_one_process(run, reference)
    graphs = graph_stats(run)
    assert [graph["graph_steps_per_bucket"] for graph in graphs] == [{"1": 6}, {"1": 6}]
    assert [graph["eager_steps"] for graph in graphs] == [2, 2]
