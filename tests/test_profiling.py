"""Profiling a run: each step's parts in steps.jsonl and summary.json, the profiler on chosen steps,
the report command (plot and summary) and the comparison of two run folders."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from executor.core.config import build_config
from executor.offline import report
from executor.offline.offline_inference import OfflineInference
from executor.platform import npu_runtime
from executor.platform.profiler import StepProfiler
from tests.engine_harness import make_inference, token_records
from tests.run_harness import run_into, summary, write_run

HOST_PARTS = {"prepare", "h2d", "forward", "sample", "output"}


@contextmanager
def log_messages() -> Iterator[list[str]]:
    """Every message logged at INFO or above while the block runs (a module fixture has no caplog)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    root, handler = logging.getLogger(), Collect(logging.INFO)
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, tiny_llama_dir) -> tuple[Path, list[str]]:
    """A CPU run of 10 requests (batch 3, 6 tokens each) with prefill step 0 and decode steps 1 and
    99 (never reached) profiled: its folder and its log."""
    tmp_path = tmp_path_factory.mktemp("profiled_run")
    run_yaml = write_run(tmp_path, tiny_llama_dir)
    out = tmp_path / "out"
    overrides = (
        "model_config.enable_profiler=true",
        "model_config.profile_prefill_steps=[0]",
        "model_config.profile_decode_steps=[1, 99]",
    )
    with log_messages() as messages:
        assert run_into(run_yaml, out, *overrides) == 0
    return out, messages


def step_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_every_step_line_splits_its_time_into_parts_that_add_up(profiled_run):
    out, _ = profiled_run
    for line in step_lines(out):
        parts = line["parts_ms"]
        assert set(parts) == HOST_PARTS, line
        assert all(ms >= 0 for ms in parts.values())
        assert sum(parts.values()) == pytest.approx(line["step_time_ms"], abs=1e-6)


def test_summary_breaks_each_phase_down_and_leaves_the_profiled_steps_out(profiled_run):
    out, _ = profiled_run
    breakdown = summary(out)["step_breakdown"]
    lines = step_lines(out)
    for phase in ("prefill", "decode"):
        stats = breakdown[phase]
        assert stats["steps"] == sum(line["phase"] == phase for line in lines)
        assert set(stats["parts"]) == HOST_PARTS | {"total"}
        assert len(stats["profiled"]) == 1
        for times in stats["parts"].values():
            assert times["p50_ms"] <= times["p99_ms"]
    assert [line["profiled"] for line in lines].count(True) == 2


def test_the_chosen_steps_leave_a_trace_each_and_their_top_operators_in_the_log(profiled_run):
    out, messages = profiled_run
    assert sorted(p.name for p in (out / "prof" / "prefill").iterdir()) == ["prefill_0.pt.trace.json"]
    assert sorted(p.name for p in (out / "prof" / "decode").iterdir()) == ["decode_1.pt.trace.json"]
    trace = json.loads((out / "prof" / "decode" / "decode_1.pt.trace.json").read_text())
    assert any(str(event.get("name", "")).startswith("aten::") for event in trace["traceEvents"])
    top_ops = [m for m in messages if m.startswith("top operators of decode_1")]
    assert len(top_ops) == 1 and "Self CPU" in top_ops[0]
    assert any("profile_decode_steps [99] not profiled" in m for m in messages)
    assert any(m.startswith("decode: ") and "outlier(s)" in m for m in messages)  # the breakdown table
    assert any(m.startswith("step ") and "| prepare " in m and " output " in m for m in messages)


def test_the_breakdown_is_off_where_asked_and_speculative_steps_time_their_proposals(tiny_llama_dir):
    off = make_inference(tiny_llama_dir, model_config={"step_breakdown": False}, max_new_tokens=3)
    assert all(step.parts_ms is None for step in off.generate(token_records([[5, 6, 7]])).steps)
    config = build_config(
        {
            "model_config": {"model_path": str(tiny_llama_dir), "dtype": "float32", "device": "cpu"},
            "data_config": {"apply_chat_template": False, "input_truncated_len": 0},
            "scheduler_config": {"block_size": 16, "max_new_tokens": 8, "ignore_eos": True},
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
        },
        source="test.yaml",
    )
    steps = OfflineInference(config, str(tiny_llama_dir)).generate(token_records([[5, 6, 5, 6, 5, 6]])).steps
    assert all(set(step.parts_ms) == HOST_PARTS | {"propose"} for step in steps)


def test_report_draws_the_run_and_prints_its_breakdown(profiled_run, tmp_path, capsys):
    out, _ = profiled_run
    folder = tmp_path / "run"
    shutil.copytree(out, folder)
    assert report.main([str(folder)]) == 0
    assert (folder / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "=== run complete" in printed and "decode: " in printed and "mean ms" in printed


def test_compare_prints_each_part_before_and_after_with_its_change(profiled_run, tmp_path, capsys):
    before, _ = profiled_run
    after = tmp_path / "after"
    shutil.copytree(before, after)
    slower = []
    for line in step_lines(before):  # the same run with every forward pass 5 ms longer (same outliers)
        line["step_time_ms"] += 5.0
        line["parts_ms"]["forward"] += 5.0
        slower.append(json.dumps(line))
    (after / "steps.jsonl").write_text("\n".join(slower) + "\n")
    assert report.main(["--compare", str(before), str(after)]) == 0
    printed = capsys.readouterr().out.splitlines()
    decode_rows = printed[printed.index(next(line for line in printed if line.startswith("decode mean ms"))) + 1 :]
    rows = {line.split()[0]: line.split() for line in decode_rows if line.startswith("  ")}
    assert float(rows["forward"][3]) == pytest.approx(5.0) and float(rows["total"][3]) == pytest.approx(5.0)
    assert rows["prepare"][3:] == ["+0.000", "+0.0%"]
    # both figures are printed rounded: the change to 0.1 point, the mean before to a few decimals
    assert float(rows["forward"][4].rstrip("%")) == pytest.approx(500 / float(rows["forward"][1]), rel=1e-2, abs=0.05)


@pytest.mark.parametrize("setup", ["missing", "no_steps", "not_step_lines"])
def test_report_on_a_bad_folder_is_one_line_naming_it(tmp_path, capsys, setup):
    folder = tmp_path / "not-a-run"
    if setup != "missing":
        folder.mkdir()
    if setup == "not_step_lines":
        (folder / "steps.jsonl").write_text('{"id": "r0", "output_text": "an outputs.jsonl line"}\n')
    assert report.main([str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(folder) in err


class FakeNpuProfiler:
    """A stand-in for torch_npu.profiler: records the calls; its trace handler's analysis writes
    an op_statistic.csv as torch_npu's does."""

    class ProfilerActivity:
        CPU, NPU = "cpu", "npu"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def tensorboard_trace_handler(self, dir_name: str) -> str:
        return dir_name

    @contextmanager
    def profile(self, **kwargs) -> Iterator[None]:
        self.calls.append(kwargs)
        yield
        analysis = Path(kwargs["on_trace_ready"]) / "host_1_20260101000000000_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
        analysis.mkdir(parents=True)
        (analysis / "op_statistic.csv").write_text(
            "Device_id,OP Type,Core Type,Count,Total Time(us)\n0,Add,AI_VECTOR_CORE,4,12.5\n0,MatMul,AI_CORE,2,300\n"
        )


def test_npu_steps_go_through_torch_npu_profiler(tmp_path, monkeypatch, caplog):
    fake = FakeNpuProfiler()
    monkeypatch.setattr(npu_runtime, "torch_npu", lambda: type("torch_npu", (), {"profiler": fake}))
    profiler = StepProfiler("npu", tmp_path / "prof", prefill_steps=[], decode_steps=[0])
    caplog.set_level(logging.INFO)
    with profiler.profile("decode") as profiled:
        assert profiled
    (call,) = fake.calls
    assert call["activities"] == ["cpu", "npu"] and call["on_trace_ready"] == str(tmp_path / "prof/decode/decode_0")
    table = caplog.text.split("top operators of decode_0", 1)[1]
    assert table.index("MatMul") < table.index("Add")  # by total device time


def test_npu_profiling_without_torch_npu_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(npu_runtime, "is_torch_npu_installed", lambda: False)
    npu_runtime.torch_npu.cache_clear()
    profiler = StepProfiler("npu", tmp_path, prefill_steps=[0], decode_steps=[])
    with pytest.raises(npu_runtime.NpuUnavailableError, match="needs torch_npu"), profiler.profile("prefill"):
        pass
