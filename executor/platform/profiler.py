"""A profiler for the platform: torch.profiler on CPU/CUDA, torch_npu.profiler on NPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from executor.platform import npu_runtime


@contextlib.contextmanager
def profile_run(device_type: str, trace_dir: Path) -> Iterator[None]:
    """Profile the enclosed block and write a trace under `trace_dir`."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    if device_type == "npu":
        npu_profiler = npu_runtime.torch_npu().profiler
        activities = [npu_profiler.ProfilerActivity.CPU, npu_profiler.ProfilerActivity.NPU]
        with npu_profiler.profile(
            activities=activities, on_trace_ready=npu_profiler.tensorboard_trace_handler(str(trace_dir))
        ):
            yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        yield
    prof.export_chrome_trace(str(trace_dir / "trace.json"))
