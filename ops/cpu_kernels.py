"""C++ kernels for the CPU, built on first use with torch's extension loader (cached afterwards).

The torch reference gathers each request's K/V into a padded copy before attending; on the CPU
the decode kernel reads the paged cache in place (ops/csrc). Where no compiler is found or the
build fails, the reference runs instead, and the log says why once. The build is keyed by the CPU's
vector extensions, so a cache shared by machines of different kinds never runs the wrong code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_FORWARD = (
    "torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache, "
    "torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t sliding_window, "
    "c10::optional<torch::Tensor> sinks);"
)


def _vector_flags() -> list[str]:
    """-mavx2 -mfma where the CPU has them (the decode shapes gain little from AVX-512)."""
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags else []


@functools.cache
def paged_decode_attention() -> Callable[..., torch.Tensor] | None:
    """The built kernel (same arguments as torch_ref.paged_decode_attention), or None."""
    from torch.utils.cpp_extension import load_inline  # imports setuptools: only when a kernel is wanted

    flags = _vector_flags()
    name = "infer_recipes_cpu_decode" + ("_avx2" if flags else "")
    try:
        module = load_inline(
            name=name,
            cpp_sources=[_FORWARD, SOURCE.read_text()],
            functions=["paged_decode_attention"],
            extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", *flags],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler, missing headers: the reference still works
        logger.warning("CPU decode attention kernel unavailable (%s); using the torch reference", exc)
        return None
    return module.paged_decode_attention
