"""Tensor, data and expert parallelism under torchrun on CPU (gloo): greedy outputs equal to one
process's, one outputs.jsonl in prompt order, bytes per collective in the step log, and a failing
rank that stops the run with its rank named.

Tensor parallelism changes the order of the fp32 sums in the row-parallel all-reduces (and expert
parallelism the order of the experts' sum), so logits move by rounding: the tests bound the largest
difference of the chosen tokens' logprobs beside the token equality.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from executor.offline.dataset import DATASET_DIR, load_prompts, tokenize_record
from executor.offline.durable_io import read_jsonl
from executor.offline.exit_status import COULD_NOT_START, STOPPED_ON_ERROR
from tests import deepseek_v3_harness, longcat_flash_harness
from tests.conftest import save_tiny_llama
from tests.dist_fault_entry import FAULT_CALL_ENV, FAULT_KILL_ENV, FAULT_MESSAGE
from tests.dist_harness import (
    ROOT,
    RUN_ENV,
    RUN_TIMEOUT_S,
    DistRun,
    entry_args,
    max_logprob_difference,
    parallel_overrides,
    run_distributed,
    run_one_process,
    start_distributed,
    token_ids,
)
from tests.engine_harness import ENGINE_CONFIG, hf_greedy, load_hf_model
from tests.factories import TINY_VOCAB, deepseek_config, longcat_flash_config, qwen_config, tiny_tokenizer
from tests.run_harness import outputs_by_id, run_into, summary, write_run
from tests.test_qwen3_5_parity import FAMILIES as QWEN3_5_FAMILIES
from tests.test_qwen3_5_parity import qwen3_5_config
from tests.test_qwen3_5_parity import save_checkpoint as save_qwen3_5_checkpoint
from tests.test_qwen_parity import save_checkpoint as save_qwen_checkpoint

NUM_PROMPTS = 6
LOGPROBS = "data_config.logprobs=0"  # the chosen token's logprob on every output line
# Largest logprob difference the fp32 sum order may cause on these tiny models.
FP32_REORDER_BOUND = 1e-4
SMOLLM2_NEW_TOKENS = 16


def assert_ran(run: DistRun) -> None:
    assert run.returncode == 0, run.output[-4000:]


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory, tiny_llama_dir) -> tuple[Path, dict[str, dict]]:
    """The tiny Llama (4 heads over 2 KV heads) over 6 token prompts, and its one-process outputs."""
    tmp = tmp_path_factory.mktemp("dist_llama")
    run_yaml = write_run(tmp, tiny_llama_dir, num_prompts=NUM_PROMPTS)
    return run_yaml, run_one_process(run_yaml, tmp / "one_process", LOGPROBS)


def test_a_layout_the_model_cannot_split_is_refused_before_it_loads_with_each_problem(llama_case, tmp_path, capsys):
    run_yaml, _ = llama_case
    assert run_into(run_yaml, tmp_path / "refused", *parallel_overrides(3, attn_tp_size=3)) == COULD_NOT_START
    err = capsys.readouterr().err
    assert "parallel_config.attn_tp_size 3 does not divide the model's num_attention_heads 4" in err
    assert "num_key_value_heads 2" in err
    assert "parallel_config.world_size is 3 but it runs in one process" in err
    assert not (tmp_path / "refused").exists()


def test_cpu_npugraph_ex_and_a_draft_model_the_layout_cannot_split_are_refused_for_several_processes(
    llama_case, tmp_path, capsys
):
    """Graphs (ge_graph) and speculation run above one process (tests/test_graphs_across_processes.py,
    tests/test_spec_decode_distributed.py), but not the CPU's npugraph_ex packages, and a draft model
    must split by the layout as the target does."""
    run_yaml, _ = llama_case
    draft = save_tiny_llama(tmp_path / "draft", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    overrides = ["model_config.exe_mode=npugraph_ex", "speculative_config.method=draft_model"]
    overrides += [f"speculative_config.draft_model_path={draft}", "speculative_config.num_speculative_tokens=2"]
    overrides += parallel_overrides(2, attn_tp_size=2)
    assert run_into(run_yaml, tmp_path / "refused", *overrides) == COULD_NOT_START
    err = capsys.readouterr().err
    assert "exe_mode 'npugraph_ex' on the cpu (AOTInductor packages) hangs" in err
    assert f"the draft model ({draft}): parallel_config.attn_tp_size 2 does not divide the model's " in err
    assert "num_attention_heads 3" in err and "speculative decoding" not in err


def test_attention_tp_2_gives_one_process_tokens_and_logs_bytes_per_collective(llama_case, tmp_path):
    run_yaml, reference = llama_case
    sizes = dict(attn_tp_size=2, dense_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)
    run = run_distributed(run_yaml, tmp_path / "tp2", [LOGPROBS, *parallel_overrides(2, **sizes)])
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    first_step = run.steps()[0]
    hidden_bytes = first_step["num_tokens"] * 64 * 4  # [tokens, hidden 64] fp32
    assert first_step["comm_bytes"]["attn_tp.all_reduce"] == 2 * hidden_bytes  # o_proj, per layer
    assert first_step["comm_bytes"]["dense_tp.all_reduce"] == 2 * hidden_bytes  # down_proj, per layer
    assert first_step["comm_bytes"]["embed_tp.all_reduce"] == hidden_bytes
    assert first_step["comm_bytes"]["lmhead_tp.all_gather"] > 0


def test_data_parallel_2_writes_every_replicas_outputs_in_prompt_order(llama_case, tmp_path):
    run_yaml, reference = llama_case
    run = run_distributed(run_yaml, tmp_path / "dp2", [LOGPROBS, *parallel_overrides(2)])
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert run.output_ids_in_file_order() == [f"r{i}" for i in range(NUM_PROMPTS)]
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    assert run.steps() and run.steps("steps_dp1.jsonl")  # each replica's step log, apart
    run_summary = summary(run.out)
    assert run_summary["status"] == "complete"
    assert run_summary["requests"] == NUM_PROMPTS


@pytest.mark.slow
def test_tp_2_by_dp_2_on_four_processes_gives_one_process_tokens(llama_case, tmp_path):
    run_yaml, reference = llama_case
    run = run_distributed(run_yaml, tmp_path / "tp2dp2", [LOGPROBS, *parallel_overrides(4, attn_tp_size=2)])
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert run.output_ids_in_file_order() == [f"r{i}" for i in range(NUM_PROMPTS)]
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND


@pytest.mark.slow
def test_embedding_and_lm_head_tp_may_differ_from_attention_tp(llama_case, tmp_path):
    run_yaml, reference = llama_case
    sizes = dict(attn_tp_size=2, embed_tp_size=1, lmhead_tp_size=2)
    run = run_distributed(run_yaml, tmp_path / "mixed", [LOGPROBS, *parallel_overrides(2, **sizes)])
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert "embed_tp.all_reduce" not in run.steps()[0]["comm_bytes"]  # replicated embedding: no collective


def save_moe_folder(path: Path, family: str) -> Path:
    if family == "deepseek_v3":
        deepseek_v3_harness.save_checkpoint(path, deepseek_config())
    elif family == "longcat_flash":
        longcat_flash_harness.save_checkpoint(path, longcat_flash_config())
    else:
        save_qwen_checkpoint(path, qwen_config(family))
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "longcat_flash"])
def test_expert_parallel_2_gives_one_process_tokens(family, tmp_path):
    model_dir = save_moe_folder(tmp_path / "model", family)
    run_yaml = write_run(tmp_path, model_dir, num_prompts=4)
    name = f"model_config.model_name={family}"
    reference = run_one_process(run_yaml, tmp_path / "one_process", name, LOGPROBS)
    sizes = dict(attn_tp_size=2, moe_tp_size=1)  # EP = world_size / moe_tp_size = 2
    run = run_distributed(run_yaml, tmp_path / "ep2", [name, LOGPROBS, *parallel_overrides(2, **sizes)])
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    assert run.steps()[0]["comm_bytes"]["moe_ep.all_reduce"] > 0


@pytest.mark.slow
@pytest.mark.long  # 75 s for both; Gated DeltaNet at TP 2 stays in CI through the PD test of a TP-2 prefill
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_gated_deltanet_at_attention_tp_2_gives_one_process_tokens(family, tmp_path):
    """Gated DeltaNet split over attention TP (each rank a run of key heads and the value heads they
    serve, q, k and v apart), Qwen3.5's projections and Qwen3-Next's fused by key head: prefill and
    decode steps give one process's tokens."""
    model_dir = tmp_path / "model"
    save_qwen3_5_checkpoint(model_dir, qwen3_5_config(family, **ENGINE_CONFIG))
    tiny_tokenizer().save_pretrained(model_dir)
    run_yaml = write_run(tmp_path, model_dir, num_prompts=4)
    name = f"model_config.model_name={QWEN3_5_FAMILIES[family][3]}"
    reference = run_one_process(run_yaml, tmp_path / "one_process", name, LOGPROBS)
    run = run_distributed(run_yaml, tmp_path / "tp2", [name, LOGPROBS, *parallel_overrides(2, attn_tp_size=2)])
    assert_ran(run)
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    assert run.steps()[0]["comm_bytes"]["attn_tp.all_reduce"] > 0


# Lock-step data parallelism: 3 prompts over 2 replicas, one request at a time. Replica 0 serves r0
# (2 new tokens) then r2 (4), replica 1 serves r1 (8): replica 0's prefill of r2 meets replica 1's
# decode, and replica 0 runs out of work before replica 1, so it runs idle forwards.
UNEVEN_NEW_TOKENS = {"r0": 2, "r1": 8, "r2": 4}
UNEVEN = ["scheduler_config.batch_size=1", LOGPROBS]
# Real steps of each replica (a prefill, then a decode per further token) and replica 0's idle forwards.
UNEVEN_STEPS, UNEVEN_IDLE_STEPS = [1 + 1 + 1 + 3, 1 + 7], [2, 0]
# The same with the 3-token prompts prefilled in chunks of 2: each prompt takes a step that samples no row.
CHUNKED = "scheduler_config.max_prefill_tokens=2"
CHUNKED_STEPS, CHUNKED_IDLE_STEPS = [2 + 1 + 2 + 3, 2 + 7], [1, 0]


def write_uneven_run(tmp_path: Path, model_dir: Path) -> Path:
    """write_run's 3 token-id prompts, each with its own max_new_tokens (UNEVEN_NEW_TOKENS)."""
    run_yaml = write_run(tmp_path, model_dir, num_prompts=len(UNEVEN_NEW_TOKENS))
    dataset = tmp_path / "prompts.jsonl"
    lines = [json.loads(line) for line in dataset.read_text().splitlines()]
    lines = [line | {"max_new_tokens": UNEVEN_NEW_TOKENS[line["id"]]} for line in lines]
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_yaml


def assert_lock_step_equals_one_process(
    run: DistRun, reference: dict[str, dict], steps: list[int] = UNEVEN_STEPS, idle: list[int] = UNEVEN_IDLE_STEPS
) -> None:
    """Same tokens and logprobs within rounding as one process; each replica's log holds its real steps
    only, and the idle forwards are counted in its summary."""
    assert_ran(run)
    assert {request_id: len(ids) for request_id, ids in token_ids(reference).items()} == UNEVEN_NEW_TOKENS
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    assert [len(run.steps()), len(run.steps("steps_dp1.jsonl"))] == steps
    replicas = summary(run.out)["parts"][-1]["data_parallel_replicas"]
    assert [replica["lock_step_idle_steps"] for replica in replicas] == idle


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "longcat_flash"])
def test_expert_parallel_across_data_parallel_replicas_gives_one_process_tokens(family, tmp_path):
    """Attention TP 1 x DP 2 x EP 2 (cann-recipes' qwen3_moe layout at world 2): each MoE layer gathers
    both replicas' tokens over moe_ep, and the replica without work runs idle forwards."""
    model_dir = save_moe_folder(tmp_path / "model", family)
    run_yaml = write_uneven_run(tmp_path, model_dir)
    name = f"model_config.model_name={family}"
    reference = run_one_process(run_yaml, tmp_path / "one_process", name, *UNEVEN)
    sizes = dict(attn_tp_size=1, moe_tp_size=1)  # DP 2, EP 2
    run = run_distributed(run_yaml, tmp_path / "dp2ep2", [name, *UNEVEN, *parallel_overrides(2, **sizes)])
    assert_lock_step_equals_one_process(run, reference)
    first_step = run.steps()[0]  # both replicas prefill 3 tokens
    hidden_bytes = 3 * 64 * 4  # [tokens, hidden 64] fp32
    num_moe_layers = 3 if family == "qwen3_moe" else 2
    assert first_step["comm_bytes"]["moe_ep.gather_rows"] == num_moe_layers * (8 + hidden_bytes)  # count, rows
    assert first_step["comm_bytes"]["moe_ep.all_reduce"] == num_moe_layers * 2 * hidden_bytes  # both replicas' rows


def test_embedding_lm_head_and_dense_tp_across_data_parallel_replicas_give_one_process_tokens(tiny_llama_dir, tmp_path):
    """Attention TP 1 x DP 2 with embedding, LM head and dense FFN TP 2 (cann-recipes' gemma_4 shape):
    ids, hidden rows and sampled rows are gathered across the replicas, which step in lock-step.
    Prompts prefill in chunks, so a replica's step that samples no row meets the other's that does."""
    run_yaml = write_uneven_run(tmp_path, tiny_llama_dir)
    reference = run_one_process(run_yaml, tmp_path / "one_process", *UNEVEN, CHUNKED)
    sizes = dict(attn_tp_size=1, dense_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)
    run = run_distributed(run_yaml, tmp_path / "dp2tp2", [*UNEVEN, CHUNKED, *parallel_overrides(2, **sizes)])
    assert_lock_step_equals_one_process(run, reference, CHUNKED_STEPS, CHUNKED_IDLE_STEPS)
    first, second = (step["comm_bytes"] for step in run.steps()[:2])
    hidden_bytes = 2 * 64 * 4  # both replicas prefill 2 tokens, [tokens, hidden 64] fp32
    assert first["embed_tp.gather_rows"] == 8 + 2 * 8  # count, then 2 int64 ids
    assert first["embed_tp.all_reduce"] == 2 * hidden_bytes  # both replicas' rows
    assert first["dense_tp.gather_rows"] == 2 * (8 + hidden_bytes)  # per layer
    assert first["dense_tp.all_reduce"] == 2 * 2 * hidden_bytes
    assert first["lmhead_tp.gather_rows"] == 8  # no replica samples: counts only
    assert "lmhead_tp.all_gather" not in first
    assert second["lmhead_tp.gather_rows"] == 8 + 64 * 4  # each replica samples its prompt's last row
    assert second["lmhead_tp.all_gather"] == 2 * (TINY_VOCAB // 2) * 4  # 2 rows of this rank's vocab half


def test_a_rank_that_raises_stops_the_run_with_its_rank_named(llama_case, tmp_path):
    run_yaml, _ = llama_case
    timeout_s = 60
    overrides = [*parallel_overrides(2, attn_tp_size=2), f"parallel_config.collective_timeout_s={timeout_s}"]
    start_s = time.monotonic()
    run = run_distributed(run_yaml, tmp_path / "fails", overrides, entry=["tests/dist_fault_entry.py"], nproc=2)
    assert run.returncode != 0
    assert f"error: rank 1 of 2 failed: {FAULT_MESSAGE}" in run.output
    assert time.monotonic() - start_s < timeout_s + 60  # start-up, then at most one collective timeout


def test_closing_the_groups_leaves_no_gloo_worker_to_the_finalizing_interpreter():
    """CommManager.close joins the gloo worker threads: a worker still releasing its last
    collective's tensors at interpreter exit took the GIL from a finalizing interpreter and aborted
    a rank that had finished its run (SIGABRT, "terminate called without an active exception");
    tests/dist_close_entry.py makes that schedule certain."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*command, "tests/dist_close_entry.py"],
        cwd=ROOT,
        env=RUN_ENV,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


# One request at a time per replica, each a prefill and 5 decodes (6 forwards; the warm-up makes 2):
# replica 1 (rank 1) serves r1, r3, r5 and raises in r3's second decode, when r1 is finished.
ONE_AT_A_TIME = "scheduler_config.batch_size=1"
REPLICA_1_FAULT_CALL = 2 + 6 + 3


def test_a_data_parallel_run_whose_replica_fails_keeps_finished_requests_and_resumes(llama_case, tmp_path):
    """DP 2: each replica's leader writes its finished requests as they finish, so the failure of
    replica 1 loses none of them (nor replica 0's); rerunning the command serves only the rest and
    merges everything into one outputs.jsonl in prompt order, equal to one process's."""
    run_yaml, reference = llama_case
    out, overrides = tmp_path / "dp2", [LOGPROBS, ONE_AT_A_TIME, *parallel_overrides(2)]
    entry = ["tests/dist_fault_entry.py"]
    failed = run_distributed(run_yaml, out, overrides, entry, nproc=2, env={FAULT_CALL_ENV: str(REPLICA_1_FAULT_CALL)})
    assert failed.returncode != 0
    not_info = "\n".join(line for line in failed.output.splitlines() if " INFO " not in line)
    assert f"error: rank 1 of 2 failed: {FAULT_MESSAGE}" in failed.output, not_info
    kept = [[line["id"] for line in read_jsonl(out / f"outputs_dp{d}.jsonl").lines] for d in (0, 1)]
    assert kept[1] == ["r1"], failed.output[-4000:]
    assert kept[0] == ["r0", "r2", "r4"][: len(kept[0])]  # as far as replica 0 got before it was stopped
    assert (out / "outputs.jsonl").read_text() == ""  # no merge: the end gather never happened
    assert summary(out)["status"] != "complete"
    assert len(failed.steps("steps_dp1.jsonl")) == REPLICA_1_FAULT_CALL - 2 - 1  # replica 1's steps before the fault

    resumed = run_distributed(run_yaml, out, overrides)
    assert_ran(resumed)
    assert resumed.output_ids_in_file_order() == [f"r{i}" for i in range(NUM_PROMPTS)]  # each once
    assert token_ids(outputs_by_id(out)) == token_ids(reference)
    assert max_logprob_difference(outputs_by_id(out), reference) <= FP32_REORDER_BOUND
    assert not list(out.glob("outputs_dp*.jsonl"))
    whole = summary(out)
    assert whole["status"] == "complete" and whole["requests"] == NUM_PROMPTS and whole["pending_requests"] == 0
    served_before = len(kept[0]) + len(kept[1])
    assert whole["parts"][-1]["requests"] == NUM_PROMPTS - served_before  # none served twice


def test_a_rank_killed_by_sigkill_is_named_with_one_line_per_rank_and_the_run_resumes(llama_case, tmp_path):
    """DP 2 under the launcher: rank 1 killed by SIGKILL in its third request. The launcher names the
    lost rank, rank 0 says it stopped (the other rank lost) with the resume command, or that it was
    interrupted by torchrun's SIGTERM, which also gives it; no traceback. The command then completes."""
    run_yaml, reference = llama_case
    out, overrides = tmp_path / "killed", [LOGPROBS, ONE_AT_A_TIME, *parallel_overrides(2)]
    fault = {FAULT_CALL_ENV: str(REPLICA_1_FAULT_CALL), FAULT_KILL_ENV: "1"}
    command = [sys.executable, "tests/dist_fault_launch.py", *entry_args(run_yaml, out, overrides)]
    done = subprocess.run(
        command, cwd=ROOT, env=RUN_ENV | fault, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == STOPPED_ON_ERROR, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    lost = [line for line in output.splitlines() if "rank 1 of 2" in line]
    assert lost == [f"error: rank 1 of 2 was lost: killed by SIGKILL (pid {lost[0].split('(pid ')[1]}"], lost
    assert "the other ranks stopped because of it" in lost[0]
    rank_0_lines = ("rank 0 of 2 stopped: another rank was lost", "interrupted (SIGTERM)")
    (rank_0,) = [line for line in output.splitlines() if any(words in line for words in rank_0_lines)]
    assert f"to resume, run: python -m executor.offline.launch --yaml {run_yaml}" in rank_0

    resumed = run_distributed(run_yaml, out, overrides)
    assert_ran(resumed)
    assert resumed.output_ids_in_file_order() == [f"r{i}" for i in range(NUM_PROMPTS)]
    assert token_ids(outputs_by_id(out)) == token_ids(reference)


# Enough work that the run is still serving when the signal comes: 40 requests one at a time, 240 tokens each.
LONG_RUN = [f"scheduler_config.{key}" for key in ("batch_size=1", "max_new_tokens=240", "max_model_len=256")]
STOP_BOUND_S = 60  # from the signal to every process gone: a step, the run folder, torchrun's shutdown


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, launcher: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not condition():
        assert launcher.poll() is None, f"the run ended before it served a step:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, "no step within RUN_TIMEOUT_S"
        time.sleep(0.1)


@pytest.mark.parametrize("sizes", [dict(attn_tp_size=2), dict(attn_tp_size=1)], ids=["tp2", "dp2"])
def test_ctrl_c_stops_every_rank_and_the_run_folder_says_interrupted(tiny_llama_dir, tmp_path, sizes):
    """A terminal's Ctrl-C (SIGINT to the launcher's process group) while the ranks serve: every process
    exits within STOP_BOUND_S with 130, as one process does, and summary.json says interrupted."""
    run_yaml, out, log = write_run(tmp_path, tiny_llama_dir, num_prompts=40), tmp_path / "out", tmp_path / "log"
    launcher = start_distributed(run_yaml, out, [*LONG_RUN, *parallel_overrides(2, **sizes)], log)
    try:
        steps = out / "steps.jsonl"  # grows as (replica 0's) steps end
        wait_for(lambda: steps.is_file() and steps.read_text().strip(), launcher, log)
        ranks = child_pids(launcher.pid)
        assert len(ranks) == 2
        os.killpg(launcher.pid, signal.SIGINT)
        start_s = time.monotonic()
        status = launcher.wait(timeout=STOP_BOUND_S)
        assert time.monotonic() - start_s < STOP_BOUND_S
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    output = log.read_text()
    assert status == 130, output[-4000:]
    assert [pid for pid in ranks if is_running(pid)] == []
    assert output.count("interrupted (SIGINT)") == 2, output[-4000:]  # each rank stopped itself
    interrupted = summary(out)
    assert interrupted["status"] == "interrupted", output[-4000:]
    assert "to resume, run: python -m executor.offline.launch --yaml" in output
    assert 0 < interrupted["pending_requests"] <= 40
    # DP: the replicas' files were merged after the stop; every line is in outputs.jsonl
    assert not list(out.glob("outputs_dp*.jsonl"))
    assert interrupted["requests"] == len(outputs_by_id(out)) == 40 - interrupted["pending_requests"]


def write_smollm2_run(tmp_path: Path, model_dir: Path, prompts: list[list[int]]) -> Path:
    dataset = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt_token_ids": ids}) for i, ids in enumerate(prompts)]
    dataset.write_text("\n".join(lines) + "\n")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        f"model_config:\n  model_path: {model_dir}\n  dtype: float32\n  device: cpu\n"
        f"data_config:\n  dataset_path: {dataset}\n  input_truncated_len: 0\n"
        f"scheduler_config:\n  batch_size: {len(prompts)}\n  max_new_tokens: {SMOLLM2_NEW_TOKENS}\n"
        "  block_size: 16\n  max_model_len: 512\n"
    )
    return run_yaml


@pytest.mark.slow
def test_smollm2_at_tp_3_equals_transformers_and_one_process(smollm2_dir, tmp_path):
    """SmolLM2 has 9 query and 3 KV heads, so TP = 3; fp32, the tied embedding and LM head split too."""
    hf_model = load_hf_model(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    records = load_prompts(DATASET_DIR / "default.jsonl")[:3]
    prompts = [tokenize_record(record, tokenizer, True) for record in records]
    run_yaml = write_smollm2_run(tmp_path, smollm2_dir, prompts)
    reference = run_one_process(run_yaml, tmp_path / "one_process", LOGPROBS)
    sizes = dict(attn_tp_size=3, dense_tp_size=3, embed_tp_size=3, lmhead_tp_size=3)
    run = run_distributed(run_yaml, tmp_path / "tp3", [LOGPROBS, *parallel_overrides(3, **sizes)])
    assert_ran(run)
    expected = {f"p{i}": hf_greedy(hf_model, ids, SMOLLM2_NEW_TOKENS) for i, ids in enumerate(prompts)}
    assert token_ids(run.outputs()) == expected == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
