"""The run summary: token counts, step-time percentiles and their breakdown, TTFT, TPOT and throughput."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from executor.core.engine import PARTS, StepRecord
from executor.types_ import AcceptCounts, FinishReason, Request


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


def latency_stats(name: str, values_ms: Sequence[float]) -> dict[str, float]:
    """Mean, p50 and p99 of per-request latencies (ms), as `<name>_mean_ms` and so on."""
    return {
        f"{name}_mean_ms": statistics.fmean(values_ms) if values_ms else 0.0,
        f"{name}_p50_ms": percentile(values_ms, 50),
        f"{name}_p99_ms": percentile(values_ms, 99),
    }


def summarize(requests: Sequence[Request], records: Sequence[StepRecord], start_s: float, end_s: float) -> dict:
    served = [r for r in requests if r.finish_reason is not FinishReason.ERROR]
    ttfts = [r.ttft_s * 1e3 for r in served if r.ttft_s is not None]
    tpots = [r.tpot_s * 1e3 for r in served if r.tpot_s is not None]
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
        **latency_stats("ttft", ttfts),
        **latency_stats("tpot", tpots),
        "output_tokens_per_s": output_tokens / total_s if total_s > 0 else 0.0,
        **speculation_stats([dataclasses.asdict(r) for r in records]),
    }


def speculation_stats(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Speculative decoding over the decode steps, as cann-recipes reports it: drafts proposed and
    accepted, the accept rate, the mean accept length (tokens a request emits per verify step: its
    accepted drafts plus one) and the equivalent per-token decode time (mean decode step time over
    the mean accept length); then each draft position's counts and rate, as vLLM reports them. The
    steps may be any replicas' and parts': the counts add up. Empty when no step verified drafts."""
    counts = AcceptCounts()
    for step in steps:
        if step.get("num_draft_tokens"):
            counts.add(AcceptCounts.from_step_line(step))
    if not counts.num_drafted:
        return {}
    accept_length = 1 + counts.num_accepted / counts.verifies
    decode_ms = [s["step_time_ms"] for s in steps if s.get("phase") == "decode"]
    speculative = {
        "verify_steps": sum(1 for s in steps if s.get("num_draft_tokens")),
        "draft_tokens": counts.num_drafted,
        "accepted_tokens": counts.num_accepted,
        "accept_rate": counts.num_accepted / counts.num_drafted,
        "mean_accept_length": accept_length,
        "equivalent_decode_ms_per_token": statistics.fmean(decode_ms) / accept_length,
        "per_position": counts.per_position(),
    }
    if looked_up := looked_up_stats(steps, counts.verifies):
        speculative["looked_up"] = looked_up
    return {"speculative": speculative}


def looked_up_stats(steps: Sequence[Mapping[str, Any]], num_verifies: int) -> dict[str, Any]:
    """The verifies of drafts that prompt lookup gave in front of a drafter (speculative_config.prompt_lookup):
    their share of all verifies, their accept rate and accept length (the drafter's are the rest's).
    Empty when none was looked up."""
    verifies = sum(s.get("looked_up_verified_requests", 0) for s in steps)
    if not verifies:
        return {}
    drafted = sum(s.get("looked_up_draft_tokens", 0) for s in steps)
    accepted = sum(s.get("looked_up_accepted_tokens", 0) for s in steps)
    return {
        "verifies": verifies,
        "share_of_verifies": verifies / num_verifies,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "accept_rate": accepted / drafted,
        "mean_accept_length": 1 + accepted / verifies,
    }


def upper_fence(times: Sequence[float]) -> float:
    """cann-recipes' outlier rule: a step slower than Q3 + 1.5 x IQR is an outlier."""
    q1, q3 = percentile(times, 25), percentile(times, 75)
    return q3 + 1.5 * (q3 - q1)


def cann_decode_average_ms(decode_times_ms: Sequence[float]) -> float:
    """cann-recipes' closing decode average: the first decode step (still warming up) left out,
    then the outliers (upper_fence), and the mean of the rest; one step is its own."""
    if len(decode_times_ms) <= 1:
        return decode_times_ms[0] if decode_times_ms else 0.0
    times = decode_times_ms[1:]
    fence = upper_fence(times)
    return statistics.fmean([t for t in times if t <= fence])


def step_breakdown(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per phase (steps.jsonl lines): mean, p50 and p99 of the step time and of each of its parts.
    Profiled steps are left out (the profiler slows them); of the rest, the outliers (upper_fence
    on the step time) are listed and left out of the means, not of the percentiles."""
    phases = {phase: [s for s in steps if s.get("phase") == phase] for phase in ("prefill", "decode")}
    return {phase: _phase_breakdown(of_phase) for phase, of_phase in phases.items() if of_phase}


def _phase_breakdown(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    timed = [s for s in steps if not s.get("profiled")]
    fence = upper_fence([s["step_time_ms"] for s in timed]) if timed else 0.0
    kept = [s for s in timed if s["step_time_ms"] <= fence]
    names = [part for part in PARTS if _part_times(timed, part)] + ["total"]
    parts = {
        name: {
            "mean_ms": statistics.fmean(_part_times(kept, name)) if _part_times(kept, name) else 0.0,
            "p50_ms": percentile(_part_times(timed, name), 50),
            "p99_ms": percentile(_part_times(timed, name), 99),
        }
        for name in names
    }
    return {
        "steps": len(steps),
        "upper_fence_ms": fence,
        "outliers": [_step_id(s) for s in timed if s["step_time_ms"] > fence],
        "profiled": [_step_id(s) for s in steps if s.get("profiled")],
        "parts": parts,
    }


def _part_times(steps: Sequence[Mapping[str, Any]], name: str) -> list[float]:
    """The times of one part ("total": the whole step) over the steps that timed it."""
    if name == "total":
        return [s["step_time_ms"] for s in steps]
    return [s["parts_ms"][name] for s in steps if name in (s.get("parts_ms") or {})]


def _step_id(step: Mapping[str, Any]) -> dict[str, Any]:
    return {"part": step.get("part", 1), "step": step["step"], "step_time_ms": step["step_time_ms"]}


def breakdown_lines(breakdown: Mapping[str, Any]) -> list[str]:
    """step_breakdown() as a table per phase, for the log and the report command."""
    lines = []
    for phase, stats in breakdown.items():
        left_out = f"{len(stats['outliers'])} outlier(s) above {stats['upper_fence_ms']:.2f} ms left out of the means"
        if stats["profiled"]:
            left_out += f", {len(stats['profiled'])} profiled step(s) left out"
        lines.append(f"{phase}: {stats['steps']} steps, {left_out}")
        lines.append(f"  {'part':10s} {'mean ms':>10s} {'p50 ms':>10s} {'p99 ms':>10s}")
        for part, times in stats["parts"].items():
            lines.append(f"  {part:10s} {times['mean_ms']:10.3f} {times['p50_ms']:10.3f} {times['p99_ms']:10.3f}")
    return lines


def cann_closing_lines(
    model_name: str, decode_times_ms: Sequence[float], summary: Mapping[str, Any], num_drafts: int
) -> list[str]:
    """The closing lines cann-recipes prints after a run, in its words, from this run's figures
    (num_drafts: draft tokens per step when speculating)."""
    average_ms = cann_decode_average_ms(decode_times_ms)
    spec = summary.get("speculative")
    if not spec:
        return [f"{model_name} decode average inference time cost is {average_ms:.2f} ms"]
    return [
        f"{model_name} main and mtp model average inference time cost is {average_ms:.2f} ms",
        f"{model_name} model average equivalent latency of MTP{num_drafts} "
        f"is {average_ms / spec['mean_accept_length']:.2f} ms",
        f"The speculation accept length: {spec['mean_accept_length']:.4f}",
        f"The speculation accept rate: {spec['accept_rate']:.4f}",
    ]
