"""Which implementation the ops run: the torch reference or torch_npu, chosen once per process.

The choice is a module-level switch rather than a per-call argument so that layers stay free of
device checks; the worker sets it from `Platform.ops_backend` before building the model.
"""

from __future__ import annotations

from types import ModuleType

from executor.platform import npu_runtime
from ops import npu, torch_ref

BACKENDS: dict[str, ModuleType] = {"torch": torch_ref, "npu": npu}

_current = "torch"


def set_backend(name: str) -> None:
    """Select "torch" or "npu"; "npu" loads torch_npu now so a bad install fails here, not mid-run."""
    global _current
    if name not in BACKENDS:
        raise ValueError(f"ops backend must be one of {sorted(BACKENDS)}, got {name!r}")
    if name == "npu":
        npu_runtime.torch_npu()  # raises NpuUnavailableError with the reason
    _current = name


def current_backend() -> str:
    return _current


def implementation() -> ModuleType:
    return BACKENDS[_current]
