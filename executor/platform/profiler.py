"""StepProfiler: the chosen prefill and decode steps under the platform's profiler, one trace each.

torch.profiler on CPU/CUDA writes `<phase>_<n>.pt.trace.json` (Perfetto, chrome://tracing and
TensorBoard's profiler plugin open it) and logs its top operators; torch_npu.profiler on NPU
writes its own folder through `tensorboard_trace_handler` (analysed at the end of the step) and
the top operators come from that analysis' op_statistic.csv.
"""

from __future__ import annotations

import contextlib
import csv
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from executor.platform import npu_runtime

logger = logging.getLogger(__name__)

TOP_OPS = 15  # rows of the top-operators table logged per profiled step
PHASES = ("prefill", "decode")


class StepProfiler:
    """Counts the steps of each phase from 0 and profiles those whose number is chosen."""

    def __init__(self, device_type: str, trace_root: Path, prefill_steps: list[int], decode_steps: list[int]) -> None:
        self.device_type = device_type
        self.trace_root = trace_root
        self.chosen = {"prefill": sorted(set(prefill_steps)), "decode": sorted(set(decode_steps))}
        self.seen = dict.fromkeys(PHASES, 0)

    @contextlib.contextmanager
    def profile(self, phase: str) -> Iterator[bool]:
        """Wrap one step of `phase`; yields whether it is profiled."""
        index = self.seen[phase]
        self.seen[phase] += 1
        if index not in self.chosen[phase]:
            yield False
            return
        trace_dir = self.trace_root / phase
        trace_dir.mkdir(parents=True, exist_ok=True)
        name = f"{phase}_{index}"
        if self.device_type == "npu":
            session = _npu_session(trace_dir, name)
        else:
            session = _torch_session(self.device_type == "cuda", trace_dir, name)
        with session:
            yield True

    def close(self) -> None:
        """Say where the traces are, and which chosen steps the run never reached."""
        for phase in PHASES:
            missed = [index for index in self.chosen[phase] if index >= self.seen[phase]]
            if missed:
                logger.warning(
                    "model_config.profile_%s_steps %s not profiled: the run had %d %s step(s)",
                    phase,
                    missed,
                    self.seen[phase],
                    phase,
                )
        if any(index < self.seen[phase] for phase in PHASES for index in self.chosen[phase]):
            logger.info("profiler traces written under %s", self.trace_root)


@contextlib.contextmanager
def _torch_session(on_cuda: bool, trace_dir: Path, name: str) -> Iterator[None]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        yield
    prof.export_chrome_trace(str(trace_dir / f"{name}.pt.trace.json"))
    sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS)
    logger.info("top operators of %s (by %s):\n%s", name, sort_by, table)


@contextlib.contextmanager
def _npu_session(trace_dir: Path, name: str) -> Iterator[None]:
    """torch_npu.profiler (../shared/npu-api-facts.md, section 5); imported only here, so a CPU or
    CUDA run never needs it and an NPU run without it fails with npu_runtime's message."""
    npu_profiler = npu_runtime.torch_npu().profiler
    output_dir = trace_dir / name
    with npu_profiler.profile(
        activities=[npu_profiler.ProfilerActivity.CPU, npu_profiler.ProfilerActivity.NPU],
        record_shapes=True,
        on_trace_ready=npu_profiler.tensorboard_trace_handler(str(output_dir)),
    ):
        yield
    _log_npu_top_ops(output_dir, name)


def _log_npu_top_ops(output_dir: Path, name: str) -> None:
    """The analysis' op_statistic.csv (per operator type: count and total device time), sorted;
    where it is missing (analysis off or failed), only where the raw data is."""
    found = sorted(output_dir.glob("*/ASCEND_PROFILER_OUTPUT/op_statistic.csv"))
    if not found:
        logger.info("profile of %s written under %s (no op_statistic.csv to summarise)", name, output_dir)
        return
    with found[-1].open(newline="", encoding="utf-8") as stream:
        rows = sorted(csv.DictReader(stream), key=lambda row: -float(row.get("Total Time(us)") or 0))
    lines = [f"{'OP Type':40s} {'Count':>8s} {'Total Time(us)':>16s}"]
    lines += [
        f"{row.get('OP Type', '?'):40s} {row.get('Count', '?'):>8s} {row.get('Total Time(us)', '?'):>16s}"
        for row in rows[:TOP_OPS]
    ]
    logger.info("top operators of %s (from %s):\n%s", name, found[-1], "\n".join(lines))
