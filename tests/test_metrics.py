"""The run summary and KV-cache sizing arithmetic."""

import dataclasses

import pytest

from executor.core.engine import StepRecord
from executor.core.engine.kv_cache_sizing import plan_num_blocks
from executor.offline.metrics import (
    breakdown_lines,
    cann_closing_lines,
    cann_decode_average_ms,
    percentile,
    speculation_stats,
    step_breakdown,
    summarize,
    upper_fence,
)
from executor.offline.run_summary import run_summary
from executor.offline.summary_table import summary_lines
from executor.types_ import AcceptCounts, FinishReason
from tests.factories import make_request


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


def test_summary_counts_tokens_and_times_and_skips_failed_requests():
    ok = make_request("ok", [1, 2, 3], [4, 5, 6])
    ok.arrival_time_s, ok.first_token_time_s, ok.finish_time_s = 0.0, 0.5, 1.5
    ok.finish_reason = FinishReason.LENGTH
    bad = make_request("bad", [1] * 50)
    bad.fail("too long", 0.0)
    steps = [
        StepRecord(1, "prefill", 1, 3, 500.0, 0.1, 2, 0.0, 0, 0),
        StepRecord(2, "decode", 1, 1, 400.0, 0.1, 2, 0.0, 0, 0),
        StepRecord(3, "decode", 1, 1, 600.0, 0.1, 2, 0.0, 0, 0),
    ]
    summary = summarize([ok, bad], steps, start_s=0.0, end_s=2.0)
    assert summary["requests"] == 2 and summary["failed_requests"] == 1
    assert summary["prompt_tokens"] == 3 and summary["output_tokens"] == 3
    assert summary["decode"]["steps"] == 2 and summary["decode"]["p50_ms"] == 500.0
    assert summary["prefill"]["mean_ms"] == 500.0
    assert summary["ttft_mean_ms"] == pytest.approx(500.0)
    assert summary["tpot_mean_ms"] == pytest.approx(500.0)
    assert summary["output_tokens_per_s"] == pytest.approx(1.5)


def test_explicit_block_count_wins():
    assert (
        plan_num_blocks(
            num_blocks=7,
            bytes_per_block=10**9,
            max_blocks_in_use=1,
            free_memory_bytes=1,
            mem_fraction_static=0.5,
        )
        == 7
    )


def test_budget_is_capped_at_the_full_batch_worst_case_plus_the_null_block():
    common = dict(num_blocks=0, bytes_per_block=1000, max_blocks_in_use=4 * 7)
    assert plan_num_blocks(**common, free_memory_bytes=10**9, mem_fraction_static=0.9) == 4 * 7 + 1
    assert plan_num_blocks(**common, free_memory_bytes=10_000, mem_fraction_static=0.5) == 5


def test_no_room_for_the_null_block_and_one_more_is_an_error():
    with pytest.raises(RuntimeError, match="no memory for the null block and one KV block"):
        plan_num_blocks(
            num_blocks=0,
            bytes_per_block=1000,
            max_blocks_in_use=1,
            free_memory_bytes=1900,
            mem_fraction_static=0.9,
        )


def test_cann_decode_average_leaves_out_the_first_step_and_slow_outliers():
    assert cann_decode_average_ms([50.0, 10.0, 12.0, 11.0, 400.0]) == pytest.approx(11.0)
    assert cann_decode_average_ms([7.0]) == 7.0 and cann_decode_average_ms([]) == 0.0


def test_cann_closing_lines_are_in_cann_recipes_words():
    assert cann_closing_lines("m", [9.0, 4.0, 6.0], {}, 0) == ["m decode average inference time cost is 5.00 ms"]
    spec = {"speculative": {"mean_accept_length": 2.0, "accept_rate": 0.5}}
    lines = cann_closing_lines("m", [9.0, 4.0, 6.0], spec, 2)
    assert lines[1] == "m model average equivalent latency of MTP2 is 2.50 ms"
    assert lines[2:] == ["The speculation accept length: 2.0000", "The speculation accept rate: 0.5000"]


def step_line(step: int, phase: str, forward_ms: float, *, part: int = 1, profiled: bool = False) -> dict:
    parts = {"prepare": 1.0, "h2d": 0.5, "forward": forward_ms, "sample": 0.5, "output": 0.0}
    return {
        "part": part,
        "step": step,
        "phase": phase,
        "step_time_ms": sum(parts.values()),
        "parts_ms": parts,
        "profiled": profiled,
    }


def test_upper_fence_is_the_third_quartile_plus_one_and_a_half_iqr():
    assert upper_fence([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(4.0 + 1.5 * 2.0)


def test_breakdown_reports_outliers_and_leaves_them_out_of_the_means_not_the_percentiles():
    steps = [step_line(i, "decode", forward) for i, forward in enumerate([10.0, 11.0, 12.0, 10.0, 11.0, 200.0], 1)]
    decode = step_breakdown(steps)["decode"]
    assert [o["step"] for o in decode["outliers"]] == [6]
    assert decode["parts"]["forward"]["mean_ms"] == pytest.approx(10.8)
    assert decode["parts"]["total"]["mean_ms"] == pytest.approx(12.8)
    assert decode["parts"]["forward"]["p99_ms"] > 190.0  # the outlier still counts in the percentiles
    assert list(decode["parts"]) == ["prepare", "h2d", "forward", "sample", "output", "total"]


def test_breakdown_keeps_prefill_and_decode_apart_and_leaves_profiled_steps_out():
    steps = [
        step_line(1, "prefill", 50.0),
        step_line(2, "decode", 10.0),
        step_line(3, "decode", 90.0, profiled=True),
        step_line(1, "decode", 12.0, part=2),
    ]
    breakdown = step_breakdown(steps)
    assert breakdown["prefill"]["steps"] == 1 and breakdown["prefill"]["parts"]["forward"]["mean_ms"] == 50.0
    assert breakdown["decode"]["steps"] == 3 and breakdown["decode"]["parts"]["forward"]["mean_ms"] == 11.0
    assert breakdown["decode"]["profiled"] == [{"part": 1, "step": 3, "step_time_ms": 92.0}]
    assert breakdown["decode"]["parts"]["forward"]["p99_ms"] < 90.0


def test_breakdown_of_steps_timed_without_parts_has_the_total_only():
    steps = [{"step": 1, "phase": "decode", "step_time_ms": 5.0, "parts_ms": None}]
    assert list(step_breakdown(steps)["decode"]["parts"]) == ["total"]
    lines = breakdown_lines(step_breakdown(steps))
    assert lines[0].startswith("decode: 1 steps, 0 outlier(s)") and "total" in lines[-1]


def test_accept_counts_count_each_draft_position_of_a_verify():
    counts = AcceptCounts()
    counts.add_verify(3, 2)  # drafts 1 and 2 accepted, 3 rejected
    counts.add_verify(3, 0)
    counts.add_verify(1, 1)
    assert (counts.drafted, counts.accepted, counts.verifies) == ([3, 2, 2], [2, 1, 0], 3)
    assert (counts.num_drafted, counts.num_accepted) == (7, 3)
    other = AcceptCounts([1], [1], 1)
    counts.add(other)
    assert (counts.drafted, counts.accepted, counts.verifies) == ([4, 2, 2], [3, 1, 0], 4)
    assert counts.per_position()[0] == {"position": 1, "draft_tokens": 4, "accepted_tokens": 3, "accept_rate": 0.75}


def spec_step(step: int, drafted: list[int], accepted: list[int], verified: int, *, part: int = 1) -> dict:
    """A decode step line that verified drafts (StepRecord's speculation fields)."""
    return {
        "part": part,
        "step": step,
        "phase": "decode",
        "step_time_ms": 10.0,
        "num_draft_tokens": sum(drafted),
        "num_accepted_tokens": sum(accepted),
        "num_verified_requests": verified,
        "drafted_per_position": drafted,
        "accepted_per_position": accepted,
    }


def test_speculation_stats_add_each_position_over_steps_replicas_and_parts():
    replica_0 = [spec_step(1, [2, 2], [2, 1], 2), spec_step(1, [1, 1, 1], [1, 1, 0], 1, part=2)]
    replica_1 = [spec_step(1, [1], [0], 1), {"part": 1, "step": 2, "phase": "decode", "step_time_ms": 10.0}]
    spec = speculation_stats([*replica_0, *replica_1])["speculative"]
    assert (spec["draft_tokens"], spec["accepted_tokens"], spec["verify_steps"]) == (8, 5, 3)
    assert spec["mean_accept_length"] == 1 + 5 / 4
    assert spec["per_position"] == [
        {"position": 1, "draft_tokens": 4, "accepted_tokens": 3, "accept_rate": 0.75},
        {"position": 2, "draft_tokens": 3, "accepted_tokens": 2, "accept_rate": 2 / 3},
        {"position": 3, "draft_tokens": 1, "accepted_tokens": 0, "accept_rate": 0.0},
    ]
    assert speculation_stats(replica_1[1:]) == {}


def test_the_run_summary_counts_speculation_over_every_replicas_step_log():
    replica_0, replica_1 = [spec_step(1, [2, 1], [1, 0], 2)], [spec_step(1, [1, 1], [1, 1], 1)]
    part = {"device": "cpu", "speculative": {"method": "eagle3", "num_speculative_tokens": 2, "accept_rate": 0.5}}
    summary = run_summary("complete", [], replica_0, [part], 0, replica_1)
    assert [entry["accepted_tokens"] for entry in summary["speculative"]["per_position"]] == [2, 1]
    assert (summary["speculative"]["method"], summary["speculative"]["num_speculative_tokens"]) == ("eagle3", 2)
    assert summary["decode"]["steps"] == 1  # step times stay replica 0's
    assert "accept by draft  1: 0.667 (2/3), 2: 0.500 (1/2)" in summary_lines(summary)


def test_the_looked_up_verifies_add_up_over_parts_and_show_in_the_summary():
    """speculative_config.prompt_lookup: the verifies of looked-up drafts, counted apart per step."""
    looked_up = {"looked_up_verified_requests": 1, "looked_up_draft_tokens": 2, "looked_up_accepted_tokens": 2}
    steps = [spec_step(1, [2, 2], [2, 1], 2) | looked_up, spec_step(1, [2, 2], [0, 0], 2, part=2)]
    part = {"device": "cpu", "speculative": {"method": "eagle3", "num_speculative_tokens": 2, "prompt_lookup": True}}
    summary = run_summary("complete", [], steps, [part], 0)
    assert summary["speculative"]["prompt_lookup"] is True
    assert summary["speculative"]["looked_up"] == {
        "verifies": 1,
        "share_of_verifies": 1 / 4,
        "draft_tokens": 2,
        "accepted_tokens": 2,
        "accept_rate": 1.0,
        "mean_accept_length": 3.0,
    }
    assert "looked up        25.0% of verifies, accept length 3.00" in summary_lines(summary)
    assert "looked_up" not in speculation_stats(steps[1:])["speculative"]


def test_a_step_record_logs_and_records_its_drafts_by_position():
    record = StepRecord(4, "decode", 2, 6, 10.0, 0.1, 2, 0.0, 0, 0, 4, 3, 2, [2, 2], [2, 1])
    assert "accepted 3/4 drafts (by position 2/2 1/2), accept length 2.50" in record.log_line()
    assert AcceptCounts.from_step_line(dataclasses.asdict(record)) == AcceptCounts([2, 2], [2, 1], 2)
