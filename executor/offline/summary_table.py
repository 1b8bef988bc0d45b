"""The run's end table: what a user reads after the texts (the console and `report RUN`), from
summary.json's figures; summary.json itself stays in the run folder, named, not printed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def summary_lines(summary: Mapping[str, Any], summary_path: Path | None = None) -> list[str]:
    """One line per figure: requests, tokens, time and speed, TTFT and TPOT, step times per phase,
    the KV cache, preemptions, speculation where it ran, and where summary.json is."""
    rows = [
        (
            "requests",
            f"{summary.get('requests', 0) - summary.get('failed_requests', 0)} served, "
            f"{summary.get('failed_requests', 0)} failed, {summary.get('pending_requests', 0)} pending",
        ),
        ("tokens", f"{summary.get('prompt_tokens', 0):,} prompt, {summary.get('output_tokens', 0):,} output"),
        ("time", f"{summary.get('total_s', 0.0):.2f} s, {summary.get('output_tokens_per_s', 0.0):.1f} output tok/s"),
        ("TTFT ms", _spread(summary, "ttft")),
        ("TPOT ms", _spread(summary, "tpot")),
    ]
    for phase in ("prefill", "decode"):
        stats = summary.get(phase) or {}
        if stats.get("steps"):
            rows.append(
                (
                    f"{phase} ms/step",
                    f"mean {stats['mean_ms']:.2f}, p50 {stats['p50_ms']:.2f}, p99 {stats['p99_ms']:.2f} "
                    f"({stats['steps']} steps)",
                )
            )
    rows.append(
        (
            "KV cache",
            f"peak {summary.get('kv_blocks_peak', 0)} blocks, prefix-cache hits "
            f"{summary.get('prefix_cache_hit_rate', 0.0):.1%}, {summary.get('evictions', 0)} evictions",
        )
    )
    rows.append(("preemptions", str(summary.get("preemptions", 0))))
    spec = summary.get("speculative")
    if spec:
        rows.append(
            (
                "speculation",
                f"accept rate {spec['accept_rate']:.3f}, mean accept length {spec['mean_accept_length']:.2f}, "
                f"{spec['equivalent_decode_ms_per_token']:.2f} ms per token",
            )
        )
        by_position = [
            f"{entry['position']}: {entry['accept_rate']:.3f} ({entry['accepted_tokens']}/{entry['draft_tokens']})"
            for entry in spec.get("per_position", [])
        ]
        if by_position:
            rows.append(("accept by draft", ", ".join(by_position)))
        if looked_up := spec.get("looked_up"):
            rows.append(
                (
                    "looked up",
                    f"{looked_up['share_of_verifies']:.1%} of verifies, "
                    f"accept length {looked_up['mean_accept_length']:.2f}",
                )
            )
    if summary_path is not None:
        rows.append(("summary", str(summary_path)))
    return [f"=== run {summary.get('status', '')}".rstrip(), *(f"{label:16s} {value}" for label, value in rows)]


def _spread(summary: Mapping[str, Any], name: str) -> str:
    """`mean X, p50 Y, p99 Z`, the percentiles where the summary has them (a run of one part)."""
    shown = [f"mean {summary.get(f'{name}_mean_ms', 0.0):.1f}"]
    shown += [f"{q} {summary[f'{name}_{q}_ms']:.1f}" for q in ("p50", "p99") if f"{name}_{q}_ms" in summary]
    return ", ".join(shown)
