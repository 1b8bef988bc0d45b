"""Platform: what the rest of the harness needs to know about the device, in one object."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor.platform import npu_runtime

DEVICE_TYPES = ("auto", "cpu", "cuda", "npu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU flags of a bf16 matrix multiply faster than fp32's; without them (AVX2 only, say) torch's
# bf16 GEMMs fall back to a path about 100x slower than fp32 (docs/benchmarks.md).
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class Platform:
    device_type: str  # "cpu" | "cuda" | "npu"
    device: torch.device

    @property
    def dist_backend(self) -> str:
        """torch.distributed's backend for tensors on this device."""
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.device_type]

    def synchronize(self) -> None:
        """Wait for queued device work, so host timers measure the device."""
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device_type == "npu":
            torch.npu.synchronize(self.device)

    def empty_cache(self) -> None:
        """Return the caching allocator's free blocks to the device, so free memory reads true."""
        if self.device_type == "cuda":
            torch.cuda.empty_cache()
        elif self.device_type == "npu":
            torch.npu.empty_cache()

    def memory_info_bytes(self) -> tuple[int, int] | None:
        """(free, total) device memory, or None on the CPU."""
        if self.device_type == "cuda":
            return torch.cuda.mem_get_info(self.device)
        if self.device_type == "npu":
            return torch.npu.mem_get_info(self.device)
        return None


def detect_device_type(requested: str = "auto") -> str:
    """Resolve `model_config.device` ("auto" prefers npu, then cuda, then cpu)."""
    if requested not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {DEVICE_TYPES}, got {requested!r}")
    if requested == "npu":
        npu_runtime.torch_npu()  # raises a clear NpuUnavailableError when it cannot load
        if not torch.npu.is_available():
            raise npu_runtime.NpuUnavailableError("torch_npu loaded but sees no NPU device")
        return "npu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("model_config.device is 'cuda' but torch sees no CUDA device")
        return "cuda"
    if requested == "cpu":
        return "cpu"
    if npu_runtime.npu_is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def create_platform(requested: str = "auto", local_rank: int = 0) -> Platform:
    device_type = detect_device_type(requested)
    if device_type == "npu":
        torch.npu.set_device(local_rank)
        return Platform("npu", torch.device("npu", local_rank))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return Platform("cuda", torch.device("cuda", local_rank))
    return Platform("cpu", torch.device("cpu"))


def resolve_dtype(name: str, device_type: str = "cpu") -> torch.dtype:
    """`model_config.dtype` as a torch dtype; "auto" is bf16 where `device_type` multiplies bf16
    fast (CUDA, NPU, a CPU with AMX or AVX-512 BF16) and fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device_type != "cpu" or cpu_has_fast_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}") from None


def cpu_has_fast_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 matrix instructions (Linux's flags; False where they cannot be read)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return False
    return any(flag in flags for flag in FAST_BF16_CPU_FLAGS)
