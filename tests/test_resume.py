"""A run folder survives kill -9, Ctrl-C, SIGTERM and a full disk: rerunning the same command
continues the run, and the outputs equal those of a run never interrupted, none lost or doubled."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from executor.offline import __main__ as cli
from executor.offline import durable_io
from executor.offline.offline_inference import StepLog
from tests.run_harness import NUM_PROMPTS, outputs_by_id, run_into, summary, write_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory) -> dict[str, dict]:
    """The outputs of the same run, never interrupted."""
    tmp_path = tmp_path_factory.mktemp("reference")
    assert run_into(write_run(tmp_path, tiny_llama_dir), tmp_path / "out") == 0
    by_id = outputs_by_id(tmp_path / "out")
    assert len(by_id) == NUM_PROMPTS
    return by_id


# --- kill -9 at several points, then the same command again ------------------------------------------

# Each runs in a child process that SIGKILLs itself at one point of the run.
KILL_POINTS = {
    "while_loading": """
cli.OfflineInference = lambda *args, **kwargs: die()
""",
    "at_the_first_step": """
StepLog.record = lambda self, record: die()
""",
    "after_three_requests": """
original = ResultWriter.write_request
def write_request(self, result):
    original(self, result)
    if len(self._lines_this_part) == 3:
        die()
ResultWriter.write_request = write_request
""",
    "in_the_middle_of_writing_a_line": """
original = LineAppender.append
def append(self, obj):
    if self.path.name == "outputs.jsonl" and obj["id"] == "r4":
        data = (json.dumps(obj) + "\\n").encode()
        os.write(self._fd, data[: len(data) // 2])
        die()
    original(self, obj)
LineAppender.append = append
""",
    "before_the_last_summary": """
original = ResultWriter.finish
def finish(self, status):
    if status == "complete":
        die()
    return original(self, status)
ResultWriter.finish = finish
""",
}
CHILD = """
import json, os, signal, sys
from executor.offline import __main__ as cli
from executor.offline.durable_io import LineAppender
from executor.offline.results import ResultWriter
from executor.offline.offline_inference import StepLog
from tests.run_harness import NUM_PROMPTS, outputs_by_id, run_into, summary, write_run
def die():
    os.kill(os.getpid(), signal.SIGKILL)
{patch}
sys.exit(cli.main(sys.argv[1:]))
"""
SLOW_KILL_POINTS = {"while_loading", "at_the_first_step"}


@pytest.mark.parametrize(
    "point", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_KILL_POINTS else p for p in KILL_POINTS]
)
def test_killed_run_resumes_to_the_uninterrupted_outputs(point, tiny_llama_dir, reference, tmp_path):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(patch=KILL_POINTS[point]), "--yaml", str(run_yaml)]
        + ["--set", f"model_config.output_path={out}"],
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO), "INFER_RECIPES_LOG_LEVEL": "WARNING"},
        capture_output=True,
        text=True,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    written = (out / "outputs.jsonl").read_bytes() if (out / "outputs.jsonl").exists() else b""
    torn = bool(written) and not written.endswith(b"\n")
    assert torn == (point == "in_the_middle_of_writing_a_line")
    assert run_into(run_yaml, out) == 0
    assert outputs_by_id(out) == reference
    assert (out / "outputs.jsonl").read_bytes().endswith(b"\n")
    result = summary(out)
    assert result["status"] == "complete" and result["requests"] == NUM_PROMPTS and result["pending_requests"] == 0
    assert result["output_tokens"] == sum(len(line["output_token_ids"]) for line in reference.values())
    if point != "while_loading":  # the killed part had begun writing
        assert result["parts"][0]["status"] == "killed"


# --- reruns into the same folder ---------------------------------------------------------------------


def test_rerunning_a_finished_run_keeps_its_outputs_and_loads_no_model(
    tiny_llama_dir, reference, tmp_path, monkeypatch
):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    assert run_into(run_yaml, out) == 0
    before = (out / "outputs.jsonl").read_bytes()
    monkeypatch.setattr(cli, "OfflineInference", lambda *a, **k: pytest.fail("the model was loaded again"))
    assert run_into(run_yaml, out) == 0
    assert (out / "outputs.jsonl").read_bytes() == before
    assert summary(out)["status"] == "complete" and len(summary(out)["parts"]) == 1


def test_new_dataset_lines_are_appended_to_a_finished_run(tiny_llama_dir, reference, tmp_path):
    out = tmp_path / "out"
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=4), out) == 0
    assert run_into(write_run(tmp_path, tiny_llama_dir), out) == 0
    assert outputs_by_id(out) == reference
    assert [part["requests"] for part in summary(out)["parts"]] == [4, NUM_PROMPTS - 4]


def test_torn_tails_of_both_line_files_are_dropped_on_resume(tiny_llama_dir, reference, tmp_path, caplog):
    out = tmp_path / "out"
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=4), out) == 0
    for name in ("outputs.jsonl", "steps.jsonl"):
        with open(out / name, "ab") as file:
            file.write(b'{"id": "r4", "output_tok')
    assert run_into(write_run(tmp_path, tiny_llama_dir), out) == 0
    assert outputs_by_id(out) == reference
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert {step["part"] for step in steps} == {1, 2}
    assert caplog.text.count("dropping a torn last line") == 2


def test_lines_of_requests_that_failed_alone_count_as_done_until_deleted(tiny_llama_dir, tmp_path, monkeypatch):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir, num_prompts=2), tmp_path / "out"
    with open(tmp_path / "prompts.jsonl", "a") as dataset:
        dataset.write('{"id": "bad", "prompt_token_ids": [5, 99999]}\n')
    assert run_into(run_yaml, out) == 3
    before = (out / "outputs.jsonl").read_bytes()
    monkeypatch.setattr(cli, "OfflineInference", lambda *a, **k: pytest.fail("the model was loaded again"))
    assert run_into(run_yaml, out) == 3  # the whole run: one request failed
    assert (out / "outputs.jsonl").read_bytes() == before
    kept = [line for line in before.decode().splitlines() if '"id": "bad"' not in line]
    (out / "outputs.jsonl").write_text("\n".join(kept) + "\n")  # how a user retries a failed request
    assert run_into(run_yaml, out) == 3
    assert sorted(outputs_by_id(out)) == ["bad", "r0", "r1"]


def test_a_setting_that_changes_outputs_is_refused_naming_it(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=2), out) == 0
    capsys.readouterr()
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=2, seed=7), out) == 2
    assert "data_config.seed was 0, now 7" in capsys.readouterr().err
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=2), out, "scheduler_config.max_new_tokens=9") == 2


def test_a_setting_that_does_not_change_outputs_may_change(tiny_llama_dir, reference, tmp_path):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    assert run_into(run_yaml, out, "data_config.num_prompts=5") == 0
    assert run_into(run_yaml, out, "scheduler_config.batch_size=8", "scheduler_config.num_blocks=64") == 0
    assert outputs_by_id(out) == reference


def test_a_changed_prompt_under_a_done_id_is_refused_naming_the_request(tiny_llama_dir, tmp_path, capsys):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir, num_prompts=2), tmp_path / "out"
    assert run_into(run_yaml, out) == 0
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(dataset.read_text().replace('"prompt_token_ids": [3,', '"prompt_token_ids": [9,'))
    capsys.readouterr()
    assert run_into(run_yaml, out) == 2
    assert "request 'r0' was made from a different dataset line" in capsys.readouterr().err


def test_a_corrupt_line_before_the_last_is_refused_naming_it(tiny_llama_dir, tmp_path, capsys):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir, num_prompts=3), tmp_path / "out"
    assert run_into(run_yaml, out, "data_config.num_prompts=2") == 0
    lines = (out / "outputs.jsonl").read_text().splitlines()
    (out / "outputs.jsonl").write_text("\n".join([lines[0][:20], lines[1]]) + "\n")
    capsys.readouterr()
    assert run_into(run_yaml, out) == 2
    assert "outputs.jsonl:1: not a JSON object" in capsys.readouterr().err


# --- Ctrl-C and SIGTERM --------------------------------------------------------------------------------


def signal_at_first_step(monkeypatch, *signums: int) -> None:
    original = StepLog.record

    def record_step(self, record):
        original(self, record)
        if record.step == 1:
            for signum in signums:
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(StepLog, "record", record_step)


@pytest.mark.parametrize(("signums", "status"), [((signal.SIGINT,), 130), ((signal.SIGTERM,), 143)])
def test_a_signal_stops_after_the_step_and_the_same_command_resumes(
    signums, status, tiny_llama_dir, reference, tmp_path, monkeypatch, capsys
):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    signal_at_first_step(monkeypatch, *signums)
    assert run_into(run_yaml, out) == status
    interrupted = summary(out)
    assert interrupted["status"] == "interrupted" and interrupted["pending_requests"] == NUM_PROMPTS
    (hint,) = [line for line in capsys.readouterr().err.splitlines() if "to resume, run:" in line]
    assert f"--yaml {run_yaml}" in hint and f"model_config.output_path={out}" in hint
    monkeypatch.undo()
    assert run_into(run_yaml, out) == 0
    assert outputs_by_id(out) == reference
    assert [part["status"] for part in summary(out)["parts"]] == ["interrupted", "complete"]


def test_a_second_signal_stops_at_once(tiny_llama_dir, tmp_path, monkeypatch):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    signal_at_first_step(monkeypatch, signal.SIGINT, signal.SIGINT)
    assert run_into(run_yaml, out) == 130
    assert summary(out)["status"] == "interrupted"


def test_a_signal_while_loading_writes_nothing(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    monkeypatch.setattr(cli, "OfflineInference", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    assert run_into(run_yaml, out) == 143
    assert not out.exists()
    assert "nothing written" in capsys.readouterr().err


# --- a full disk -----------------------------------------------------------------------------------


def test_a_full_disk_names_the_file_keeps_whole_lines_and_resumes(
    tiny_llama_dir, reference, tmp_path, monkeypatch, capsys
):
    run_yaml, out = write_run(tmp_path, tiny_llama_dir), tmp_path / "out"
    real_write, calls = os.write, []

    def write(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("outputs.jsonl"):
            calls.append(fd)
            if len(calls) == 3:  # half the line reaches the disk, then it is full
                real_write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(durable_io.os, "write", write)
    assert run_into(run_yaml, out) == 1
    error = capsys.readouterr().err
    assert f"cannot write {out / 'outputs.jsonl'}: No space left on device" in error and "to resume, run:" in error
    assert len(outputs_by_id(out)) == 2  # both whole lines kept, the half line cut away
    assert summary(out)["status"] == "stopped on error"
    monkeypatch.undo()
    assert run_into(run_yaml, out) == 0
    assert outputs_by_id(out) == reference
