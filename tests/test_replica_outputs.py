"""Data-parallel replicas' own output files (outputs_dp<d>.jsonl): what a rerun counts as done, and
how rank 0 merges them into outputs.jsonl, without a model or torchrun (test_distributed.py runs
them for real)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.core.config import ConfigError, build_config
from executor.core.engine import StepRecord
from executor.offline.dataset import PromptRecord
from executor.offline.durable_io import read_jsonl
from executor.offline.offline_inference import StepLog
from executor.offline.results import ReplicaWriter, ResultWriter
from executor.offline.run_folder import plan_run, unmerged_replica_lines

CONFIG = build_config({})
RECORDS = [PromptRecord(f"r{i}", prompt=f"prompt {i}", content_hash=str(i)) for i in range(6)]


def result(request_id: str) -> dict:
    """An outputs line as request_result makes it."""
    return {
        "id": request_id,
        "prompt": "p",
        "output_text": "x",
        "output_token_ids": [7, 8],
        "prompt_tokens": 1,
        "finish_reason": "length",
        "error": None,
        "logprobs": None,
        "prompt_logprobs": None,
    }


def step(number: int) -> StepRecord:
    return StepRecord(number, "decode", 1, 1, 1.0, 0.1, 1, 0.0, 0, 0)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ids(path: Path) -> list[str]:
    return [line["id"] for line in lines(path)]


def test_unmerged_replica_lines_skip_merged_and_doubled_ids_and_follow_prompt_order():
    merged = [{"id": "r0"}]
    replica = [{"id": "r4"}, {"id": "r0"}, {"id": "gone"}, {"id": "r1"}, {"id": "r4"}]
    new = unmerged_replica_lines(merged, replica, ["r0", "r1", "r2", "r3", "r4"])
    assert [line["id"] for line in new] == ["r1", "r4", "gone"]


def test_replica_lines_of_a_killed_part_count_as_done_and_are_merged_once_in_prompt_order(tmp_path, caplog):
    # Part 1, DP 2: replica 0 (rank 0, with the ResultWriter) finishes r0, replica 1 finishes r1 and r3;
    # then the run is killed, with half a line of r5 in replica 1's file.
    plan = plan_run(tmp_path, CONFIG, RECORDS)
    writer = ResultWriter(plan, CONFIG)
    replica0, replica1 = ReplicaWriter(plan, 0), ReplicaWriter(plan, 1)
    replica0.write_request(result("r0"))
    with StepLog(replica0.step_files, console_interval=1) as log:
        log.record(step(1))
    for request_id in ("r1", "r3"):
        replica1.write_request(result(request_id))
    with StepLog(replica1.step_files, console_interval=1) as log:
        log.record(step(1))
    for closing in (replica0, replica1, writer):
        closing.close()
    with open(tmp_path / "outputs_dp1.jsonl", "a") as file:
        file.write('{"id": "r5", "outp')
    assert [line["id"] for line in read_jsonl(tmp_path / "outputs_dp1.jsonl").lines] == ["r1", "r3"]
    assert (tmp_path / "outputs.jsonl").read_text() == ""
    assert [line["part"] for line in lines(tmp_path / "steps.jsonl")] == [1]
    assert [line["part"] for line in lines(tmp_path / "steps_dp1.jsonl")] == [1]

    # Part 2: the same run again serves only what no file holds, and merges everything at its end.
    plan = plan_run(tmp_path, CONFIG, RECORDS)
    assert [record.id for record in plan.pending] == ["r2", "r4", "r5"]
    assert plan.part == 2
    writer = ResultWriter(plan, CONFIG)
    running = json.loads((tmp_path / "summary.json").read_text())
    assert running["requests"] == 3 and running["pending_requests"] == 3
    replica0, replica1 = ReplicaWriter(plan, 0), ReplicaWriter(plan, 1)
    assert "dropping a torn last line of outputs_dp1.jsonl" in caplog.text
    for request_id in ("r2", "r4"):
        replica0.write_request(result(request_id))
    replica1.write_request(result("r5"))
    with StepLog(replica1.step_files, console_interval=1) as log:
        log.record(step(1))
    replica0.close()
    replica1.close()
    writer.add_replica_results([result(request_id) for request_id in ("r2", "r4", "r5")])
    writer.write_summary({"total_s": 1.0})
    writer.merge_replica_outputs()
    done = writer.finish("complete")
    writer.close()
    assert ids(tmp_path / "outputs.jsonl") == [f"r{i}" for i in range(6)]
    assert all(line["request_hash"] == plan.request_hashes[line["id"]] for line in lines(tmp_path / "outputs.jsonl"))
    assert not list(tmp_path.glob("outputs_dp*"))
    assert [line["part"] for line in lines(tmp_path / "steps_dp1.jsonl")] == [1, 2]  # step logs stay
    assert done["requests"] == 6 and done["pending_requests"] == 0
    assert [(part["status"], part.get("requests")) for part in done["parts"]] == [("killed", None), ("complete", 3)]


def test_a_merge_cut_short_by_a_crash_is_finished_by_the_next_part_without_doubling(tmp_path):
    plan = plan_run(tmp_path, CONFIG, RECORDS[:3])
    writer = ResultWriter(plan, CONFIG)
    replica = ReplicaWriter(plan, 1)
    for request_id in ("r0", "r1", "r2"):
        replica.write_request(result(request_id))
    replica.close()
    writer.write_request(result("r0"))  # the merge had appended r0 when the run was killed
    writer.close()
    plan = plan_run(tmp_path, CONFIG, RECORDS[:3])
    assert plan.pending == []
    writer = ResultWriter(plan, CONFIG)  # a part with nothing to serve (no model loads) ...
    done = writer.finish("complete")  # ... merges at its complete end
    writer.close()
    assert ids(tmp_path / "outputs.jsonl") == ["r0", "r1", "r2"]
    assert not (tmp_path / "outputs_dp1.jsonl").exists()
    assert done["requests"] == 3 and done["status"] == "complete"


def test_a_replica_line_made_from_another_dataset_line_is_refused_naming_its_file(tmp_path):
    plan = plan_run(tmp_path, CONFIG, RECORDS)
    ResultWriter(plan, CONFIG).close()
    replica = ReplicaWriter(plan, 3)
    replica.write_request(result("r1"))
    replica.close()
    changed = [PromptRecord(r.id, prompt="other", content_hash="x") if r.id == "r1" else r for r in RECORDS]
    with pytest.raises(ConfigError, match=r"outputs_dp3\.jsonl:1: request 'r1' was made from a different"):
        plan_run(tmp_path, CONFIG, changed)


def test_replica_outputs_without_a_config_are_not_continued(tmp_path):
    (tmp_path / "outputs_dp0.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds outputs_dp0.jsonl but no config.yaml"):
        plan_run(tmp_path, CONFIG, RECORDS)


def test_a_replica_leader_makes_a_new_runs_folder_if_rank_0_has_not_yet(tmp_path):
    plan = plan_run(tmp_path / "new", CONFIG, RECORDS)  # leaves nothing behind
    replica = ReplicaWriter(plan, 1)
    replica.write_request(result("r1"))
    replica.close()
    assert ids(tmp_path / "new" / "outputs_dp1.jsonl") == ["r1"]
