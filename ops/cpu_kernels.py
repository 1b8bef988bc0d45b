"""C++ kernels for the CPU, built when the CPU backend is made, with torch's extension loader (cached
afterwards). Each kernel declares its op once, in C++ (`TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, ...)`
beside its code), so no list of names or declarations is kept here; ops/cpu.py and ops/attention/cpu.py
wrap each one with its shape guard, its fallback to the reference and, where a compiled graph calls
it, its fake.

The torch reference gathers each request's K/V into a padded copy before attending; on the CPU
the decode kernel reads the paged cache in place (ops/csrc), and the prefill kernel attends every
request of a non-decode step in one call, taking the step's own K/V from the layer rather than back
out of the cache. The fused fp32 kernels (RMSNorm with
and without the residual add, SiLU-and-mul, the rotary embedding) make one pass over memory where
the reference makes one per operator. The cache writes copy each new K/V row straight to its slot.
The quantized kernels: W8A8's per-token int8 quantization and rescale in one pass each
(int8_quant.cpp) around torch._int_mm or, on AVX2 without VNNI, an exact int16 matmul
(int16_madd_mm.cpp), and two weight-only 4/8-bit linears for decode's few rows, with fp32 rows
(wna16_linear.cpp) or rows rounded to int8 per 32 values as llama.cpp does (q8_dot_linear.cpp).
The greedy choice over a step's logits is two vector passes per row (argmax_rows.cpp).
Where no compiler is found or the build fails, the CPU backend takes the reference instead, and the
log says why once. The build is keyed by the CPU's vector extensions and the source text, so a cache shared by
machines of different kinds never runs the wrong code, and an edited kernel is never served stale.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from executor.utils.slow_phase import SLOW_AFTER_S, announced_if_slow

logger = logging.getLogger(__name__)

# Seconds of building after which the console says the kernels are being compiled.
BUILD_NOTICE_AFTER_S = SLOW_AFTER_S
# Age past which torch's build lock is taken for one a killed build left (a build takes about a minute).
STALE_BUILD_LOCK_S = 600.0

CSRC = Path(__file__).parent / "csrc"
# Built as one translation unit, in name order but for int8_linear.cpp, which calls int8_quant.cpp's row
# quantizers and so comes last.
SOURCES = tuple(sorted((path.name for path in CSRC.glob("*.cpp")), key=lambda name: (name == "int8_linear.cpp", name)))
# The fakes (shape functions) of the ops a compiled graph calls, by op name: registered by fake(), each
# beside its Python wrapper, and put on the op once the library is loaded (an op must exist first).
_FAKES: dict[str, Callable[..., Any]] = {}
_loaded = False


def fake(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `func` is the fake of torch.ops.infer_recipes_cpu.`name` (what a compiled graph sees
    of it: the output's shape and dtype)."""

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        _FAKES[name] = func
        if _loaded:
            torch.library.register_fake(f"infer_recipes_cpu::{name}", func, allow_override=True)
        return func

    return register


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read once (reading /proc/cpuinfo takes about 0.14 ms here)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def vector_flags() -> list[str]:
    """-mavx2 -mfma where the CPU has them (the decode shapes gain little from AVX-512)."""
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else []


def build_name(flags: list[str], sources: list[str], include_dir: Path) -> str:
    """The extension's name, and so its build folder: one per vector flags, source text (headers
    included) and source folder, so that an edited kernel is built afresh and checkouts never rebuild
    each other's (torch's loader rebuilds a folder whose include path changed, even for the same text)."""
    digest = hashlib.sha256("\0".join([*flags, *sources, str(include_dir)]).encode()).hexdigest()[:12]
    return "infer_recipes_cpu_kernels" + ("_avx2" if flags else "") + f"_{digest}"


def clear_stale_build_lock(name: str) -> None:
    """torch's extension loader takes a lock file in the build folder around every load and waits for
    it without end; a load killed in between (Ctrl-C in the first seconds of a run) leaves it, and
    every later run then hung before its first step. One older than STALE_BUILD_LOCK_S is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age_s > STALE_BUILD_LOCK_S:
        logger.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age_s)
        lock.unlink(missing_ok=True)


@functools.cache
def extension() -> Any | None:
    """The ops of every kernel (torch.ops.infer_recipes_cpu, each declared once, with its schema, by a
    TORCH_LIBRARY block in its ops/csrc file), or None (and a warning, once) where it cannot be built; the
    CPU backend asks once, when it is made (ops/backend.py)."""
    global _loaded
    from torch.utils.cpp_extension import load_inline  # imports setuptools: only when a kernel is wanted

    flags = vector_flags()
    # A cached build loads in well under a second; a first build compiles for about a minute, which
    # a silent console would pass off as a hang.
    building = "building the CPU kernels (ops/csrc, first use on this machine: about a minute; cached after)"
    try:
        with announced_if_slow(logger, building, BUILD_NOTICE_AFTER_S):
            sources = [(CSRC / source).read_text() for source in SOURCES]
            # Keyed by the sources too: checkouts of other versions never load each other's builds.
            headers = [header.read_text() for header in sorted(CSRC.glob("*.h"))]  # #included: unseen by the loader
            name = build_name(flags, sources + headers, CSRC)
            clear_stale_build_lock(name)
            load_inline(
                name=name,
                cpp_sources=sources,
                extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", *flags],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
                is_python_module=False,  # a plain library: its TORCH_LIBRARY blocks register the ops on load
            )
            _loaded = True
            for name, func in _FAKES.items():
                torch.library.register_fake(f"infer_recipes_cpu::{name}", func, allow_override=True)
            return torch.ops.infer_recipes_cpu
    except Exception as exc:  # no compiler, missing headers: the reference still works
        logger.warning("CPU kernels unavailable (%s); using the torch reference", exc)
        return None
