"""The run summary: token counts, step-time percentiles, TTFT, TPOT and throughput."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from executor.core.scheduler import StepRecord
from executor.core.types_ import FinishReason, Request


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def step_stats(times: Sequence[float]) -> dict[str, float | int]:
    """Count, mean, p50 and p99 of step times (ms) of one phase."""
    return {
        "steps": len(times),
        "mean_ms": statistics.fmean(times) if times else 0.0,
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
    }


def summarize(requests: Sequence[Request], records: Sequence[StepRecord], start_s: float, end_s: float) -> dict:
    served = [r for r in requests if r.finish_reason is not FinishReason.ERROR]
    ttfts = [r.first_token_time_s - r.arrival_time_s for r in served if r.first_token_time_s is not None]
    tpots = [
        (r.finish_time_s - r.first_token_time_s) / (len(r.output_token_ids) - 1)
        for r in served
        if r.finish_time_s is not None and r.first_token_time_s is not None and len(r.output_token_ids) > 1
    ]
    output_tokens = sum(len(r.output_token_ids) for r in served)
    total_s = end_s - start_s
    return {
        "requests": len(requests),
        "failed_requests": len(requests) - len(served),
        "prompt_tokens": sum(r.num_prompt_tokens for r in served),
        "output_tokens": output_tokens,
        "total_s": total_s,
        "prefill": step_stats([r.step_time_ms for r in records if r.phase == "prefill"]),
        "decode": step_stats([r.step_time_ms for r in records if r.phase == "decode"]),
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else 0.0,
        "tpot_mean_ms": statistics.fmean(tpots) * 1e3 if tpots else 0.0,
        "output_tokens_per_s": output_tokens / total_s if total_s > 0 else 0.0,
    }
