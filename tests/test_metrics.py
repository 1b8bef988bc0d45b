"""The run summary and KV-cache sizing arithmetic."""

import pytest

from executor.core.engine.kv_cache_sizing import plan_num_blocks
from executor.core.scheduler import StepRecord
from executor.core.types_ import FinishReason, Request, SamplingParams
from executor.utils.metrics import cann_closing_lines, cann_decode_average_ms, percentile, summarize


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


def test_summary_counts_tokens_and_times_and_skips_failed_requests():
    ok = Request("ok", None, [1, 2, 3], SamplingParams(), output_token_ids=[4, 5, 6])
    ok.arrival_time_s, ok.first_token_time_s, ok.finish_time_s = 0.0, 0.5, 1.5
    ok.finish_reason = FinishReason.LENGTH
    bad = Request("bad", None, [1] * 50, SamplingParams())
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
