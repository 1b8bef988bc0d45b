"""summary.json for a whole run, however many parts (interrupted, killed, resumed) it took.

Counts and token totals come from outputs.jsonl and step times from steps.jsonl, so they cover
every part, killed ones included; speculation's counts from every replica's step log
(steps.jsonl and steps_dp<d>.jsonl), as they add up. Times that only a part's own summary knows (TTFT, TPOT, wall
time) are combined from the parts that wrote one, each listed under `parts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor.offline.metrics import speculation_stats, step_breakdown, step_stats

# a part's summary names its proposer by these
PROPOSER_KEYS = ("method", "num_speculative_tokens", "quantization", "prompt_lookup")


def run_summary(
    status: str,
    output_lines: Sequence[dict[str, Any]],
    step_lines: Sequence[dict[str, Any]],
    parts: Sequence[dict[str, Any]],
    pending_requests: int,
    replica_step_lines: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """`step_lines`: steps.jsonl's (replica 0's); `replica_step_lines`: the other data-parallel
    replicas' (steps_dp<d>.jsonl), which count in the speculation figures."""
    served = [line for line in output_lines if line.get("error") is None]
    timed = [part for part in parts if part.get("total_s")]
    total_s = sum(part["total_s"] for part in timed)
    part_output_tokens = sum(part.get("output_tokens", 0) for part in timed)
    latest: dict[str, Any] = next((part for part in reversed(parts) if part.get("device")), {})
    speculation = speculation_stats([*step_lines, *replica_step_lines])
    if "speculative" in speculation:  # the proposer by name, as the latest part's summary gives it
        latest_spec = latest.get("speculative", {})
        speculation["speculative"] |= {key: latest_spec[key] for key in PROPOSER_KEYS if key in latest_spec}
    return {
        "status": status,
        "requests": len(output_lines),
        "failed_requests": len(output_lines) - len(served),
        "pending_requests": pending_requests,
        "prompt_tokens": sum(line.get("prompt_tokens", 0) for line in served),
        "output_tokens": sum(len(line.get("output_token_ids", [])) for line in served),
        "total_s": total_s,
        "prefill": step_stats([s["step_time_ms"] for s in step_lines if s.get("phase") == "prefill"]),
        "decode": step_stats([s["step_time_ms"] for s in step_lines if s.get("phase") == "decode"]),
        "step_breakdown": step_breakdown(step_lines),
        **_latencies(timed, "ttft"),
        **_latencies(timed, "tpot"),
        "output_tokens_per_s": part_output_tokens / total_s if total_s > 0 else 0.0,
        **_cache_stats(parts),
        **speculation,
        "device": latest.get("device"),
        "dtype": latest.get("dtype"),
        "linear_layers": latest.get("linear_layers"),
        "weight_bytes": latest.get("weight_bytes"),
        "kv_bytes_per_token": latest.get("kv_bytes_per_token"),
        "parts": list(parts),
    }


def _latencies(timed: Sequence[dict[str, Any]], name: str) -> dict[str, float]:
    """The parts' mean `name` latency weighted by their requests; its p50 and p99 where one part
    timed the whole run (percentiles of several parts do not combine, and outputs.jsonl holds no
    timings, so that a rerun's lines equal the first run's)."""
    figures = {f"{name}_mean_ms": _weighted_mean(timed, f"{name}_mean_ms")}
    if len(timed) == 1:
        figures |= {key: timed[0][key] for key in (f"{name}_p50_ms", f"{name}_p99_ms") if key in timed[0]}
    return figures


def _cache_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """KV cache figures over the parts: counts add up, the peak is the largest, the hit rate is
    over all the tokens looked up."""
    hit_tokens = sum(part.get("prefix_cache_hit_tokens", 0) for part in parts)
    queried_tokens = sum(part.get("prefix_cache_queried_tokens", 0) for part in parts)
    return {
        "kv_blocks_peak": max((part.get("kv_blocks_peak", 0) for part in parts), default=0),
        "prefix_cache_hit_rate": hit_tokens / queried_tokens if queried_tokens else 0.0,
        "prefix_cache_hit_tokens": hit_tokens,
        "evictions": sum(part.get("evictions", 0) for part in parts),
        "preemptions": sum(part.get("preemptions", 0) for part in parts),
    }


def _weighted_mean(parts: Sequence[dict[str, Any]], key: str) -> float:
    """Mean of the parts' means, weighted by the requests each part served."""
    weights = [part.get("requests", 0) - part.get("failed_requests", 0) for part in parts]
    total = sum(weights)
    return sum(part.get(key, 0.0) * w for part, w in zip(parts, weights, strict=True)) / total if total else 0.0
