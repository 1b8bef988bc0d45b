"""The host allocator set for a run on the CPU: freed memory kept for the next step's tensors.

glibc's malloc serves every block over its mmap threshold (32 MiB at most) with a fresh mapping
and hands it back at free, so each prefill step's large activations (a 2,500-token step's int32 or
fp32 [tokens, 3072] outputs are 30 MiB apiece) are page-faulted and zeroed by the kernel anew in
every layer: 40% of a W8A8 prefill step and 5% of an fp32 one on the default model
(docs/benchmarks.md). With mappings off and trimming off, freed blocks stay in the heap and are
reused, as tcmalloc or jemalloc (what vLLM's CPU build preloads) would do. A user who sets glibc's
own variables, or preloads another allocator, keeps that choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h) and the environment variables that set them.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
GLIBC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest, about 2 GiB of free heap kept


def keep_freed_host_memory(environ: dict[str, str] | None = None) -> bool:
    """Turn glibc's per-block mappings and heap trimming off; False (nothing changed) where the
    user chose otherwise or the C library is not glibc."""
    environ = os.environ if environ is None else environ
    preloaded = environ.get("LD_PRELOAD", "")
    if any(name in environ for name in GLIBC_VARIABLES) or "malloc" in preloaded:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
