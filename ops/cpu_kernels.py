"""C++ kernels for the CPU, built on first use with torch's extension loader (cached afterwards).

The torch reference gathers each request's K/V into a padded copy before attending; on the CPU
the decode kernel reads the paged cache in place (ops/csrc), and the prefill kernel attends every
request of a non-decode step in one call, taking the step's own K/V from the layer rather than back
out of the cache. The fused fp32 kernels (RMSNorm with
and without the residual add, SiLU-and-mul, the rotary embedding) make one pass over memory where
the reference makes one per operator. The cache writes copy each new K/V row straight to its slot.
Where no compiler is found or the build fails, the reference runs instead, and the log says why
once. The build is keyed by the CPU's vector extensions, so a cache shared by machines of different
kinds never runs the wrong code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "paged_decode_attention.cpp",
    "paged_prefill_attention.cpp",
    "fused_elementwise.cpp",
    "kv_cache_write.cpp",
    "packed_linear.cpp",
)
_DECLARATIONS = """
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t sliding_window,
    c10::optional<torch::Tensor> sinks);
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
    torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_ends,
    torch::Tensor seq_lens, double scale, int64_t sliding_window, c10::optional<torch::Tensor> sinks);
torch::Tensor fused_rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
    double eps);
torch::Tensor fused_silu_and_mul(torch::Tensor x);
std::vector<torch::Tensor> fused_apply_rotary(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
    torch::Tensor sin);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor slot_mapping);
void write_latent_cache(torch::Tensor latent, torch::Tensor latent_cache, torch::Tensor slot_mapping);
torch::Tensor pack_linear_weight(torch::Tensor weight);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
    int64_t out_features);
"""
FUNCTIONS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "fused_rms_norm",
    "fused_add_rms_norm",
    "fused_silu_and_mul",
    "fused_apply_rotary",
    "write_kv_cache",
    "write_latent_cache",
    "pack_linear_weight",
    "packed_linear",
)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read once: kernels are chosen per call on the hot path, and reading
    /proc/cpuinfo takes about 0.14 ms here."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def _vector_flags() -> list[str]:
    """-mavx2 -mfma where the CPU has them (the decode shapes gain little from AVX-512)."""
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else []


@functools.cache
def _extension() -> Any | None:
    """The built module of every kernel, or None (and a warning, once) where it cannot be built."""
    from torch.utils.cpp_extension import load_inline  # imports setuptools: only when a kernel is wanted

    flags = _vector_flags()
    try:
        return load_inline(
            name="infer_recipes_cpu_kernels" + ("_avx2" if flags else ""),
            cpp_sources=[_DECLARATIONS, *((CSRC / source).read_text() for source in SOURCES)],
            functions=list(FUNCTIONS),
            extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", *flags],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
        )
    except Exception as exc:  # no compiler, missing headers: the reference still works
        logger.warning("CPU kernels unavailable (%s); using the torch reference", exc)
        return None


def paged_decode_attention() -> Callable[..., torch.Tensor] | None:
    """The built decode attention kernel (same arguments as torch_ref.paged_decode_attention), or None."""
    extension = _extension()
    return None if extension is None else extension.paged_decode_attention


def packed_linear() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """(pack_linear_weight, packed_linear) of ops/csrc/packed_linear.cpp where the CPU has AVX2 and
    FMA and the build works, else None."""
    extension = _extension()
    if extension is None or not _vector_flags():
        return None
    return extension.pack_linear_weight, _named("packed_linear", extension.packed_linear)


def paged_prefill_attention() -> Callable[..., torch.Tensor] | None:
    """The built attention kernel of non-decode steps (same arguments as
    torch_ref.per_request_prefill_attention, with the lengths as int64 tensors), or None; None too
    while a compiler traces, which cannot see into a pybind call."""
    extension = None if torch.compiler.is_compiling() else _extension()
    if extension is None:
        return None
    return _named("paged_prefill_attention", extension.paged_prefill_attention)


def fused(name: str, *tensors: torch.Tensor) -> Callable[..., Any] | None:
    """The fused fp32 kernel `fused_<name>` where every one of `tensors` is an fp32 CPU tensor and
    no compiler is tracing (inductor fuses the reference's ops itself), else None."""
    if torch.compiler.is_compiling() or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    extension = _extension()
    if extension is None:
        return None
    return _named(f"fused_{name}", getattr(extension, f"fused_{name}"))


def cache_write(name: str, slot_mapping: torch.Tensor, *caches: torch.Tensor) -> Callable[..., None] | None:
    """The C++ cache write `name` (write_kv_cache, write_latent_cache: any dtype, one memcpy per row)
    for contiguous CPU `caches` and an int64 CPU `slot_mapping` while no compiler is tracing, else None."""
    if (
        torch.compiler.is_compiling()
        or slot_mapping.dtype != torch.int64
        or slot_mapping.device.type != "cpu"
        or any(cache.device.type != "cpu" or not cache.is_contiguous() for cache in caches)
    ):
        return None
    extension = _extension()
    return None if extension is None else _named(name, getattr(extension, name))


def _named(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel`, recorded as infer_recipes::`name` while a profiler runs (a pybind call is no aten op)."""
    if torch.autograd._profiler_enabled():
        return functools.partial(_recorded, f"infer_recipes::{name}", kernel)
    return kernel


def _recorded(label: str, kernel: Callable[..., Any], *args: Any) -> Any:
    with torch.profiler.record_function(label):
        return kernel(*args)
