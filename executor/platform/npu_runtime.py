"""The one place that imports torch_npu (and torchair through it), lazily and with clear errors.

Importing torch_npu can fail in two ways that matter (see shared/npu-api-facts.md, section 1):
an ImportError when the CANN libraries are not on the loader path, and a RuntimeError when the
installed torch is a CUDA build ("Two accelerators cannot be used at the same time").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType


class NpuUnavailableError(RuntimeError):
    """torch_npu is missing or cannot be imported on this machine."""


def is_torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


@functools.cache
def torch_npu() -> ModuleType:
    """Import torch_npu once, turning each known failure into an actionable message."""
    if not is_torch_npu_installed():
        raise NpuUnavailableError(
            "the NPU platform needs torch_npu, which is not installed: "
            "`pip install torch-npu==<your torch version>` on an Ascend machine with CANN"
        )
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise NpuUnavailableError(
            f"torch_npu is installed but could not load the CANN libraries ({exc}); "
            "run `source <CANN install path>/set_env.sh` before starting"
        ) from exc
    except RuntimeError as exc:
        raise NpuUnavailableError(
            f"torch_npu refused to load ({exc}); torch_npu needs the CPU build of torch, "
            "not a CUDA build (or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to keep it from auto-loading)"
        ) from exc


def torchair() -> ModuleType:
    """torchair ships inside torch_npu and is importable only after torch_npu is loaded."""
    torch_npu()
    return importlib.import_module("torchair")


def npu_is_available() -> bool:
    """True when torch_npu loads and sees at least one device; never raises."""
    if not is_torch_npu_installed():
        return False
    try:
        torch_npu()
    except NpuUnavailableError:
        return False
    import torch

    return bool(torch.npu.is_available())
