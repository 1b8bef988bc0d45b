"""The backend records tests build their models with, made once per (device, exe_mode, dtype)."""

from __future__ import annotations

import functools

import torch

from ops.backend import Backend, make_backend


@functools.cache
def cpu_backend(dtype: torch.dtype = torch.float32, exe_mode: str = "eager") -> Backend:
    """What the engine runs on this machine's CPU for a model of `dtype` (its C++ kernels where they build)."""
    return make_backend("cpu", exe_mode, dtype)


@functools.cache
def reference_backend() -> Backend:
    """The CPU record without the C++ kernels: the torch reference for every op."""
    return make_backend("cpu", "eager", torch.float32, cpu_extension=False, prepack_weights=False)
