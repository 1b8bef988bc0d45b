"""C++ kernels for the CPU, built when the CPU backend is made, with torch's extension loader (cached
afterwards); ops/cpu.py wraps each one with its shape guard and its fallback to the reference.

The torch reference gathers each request's K/V into a padded copy before attending; on the CPU
the decode kernel reads the paged cache in place (ops/csrc), and the prefill kernel attends every
request of a non-decode step in one call, taking the step's own K/V from the layer rather than back
out of the cache. The fused fp32 kernels (RMSNorm with
and without the residual add, SiLU-and-mul, the rotary embedding) make one pass over memory where
the reference makes one per operator. The cache writes copy each new K/V row straight to its slot.
The quantized kernels: W8A8's per-token int8 quantization and rescale in one pass each around
torch._int_mm (int8_quant.cpp), and a weight-only 4/8-bit linear for decode's few rows (wna16_linear.cpp).
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
from pathlib import Path
from typing import Any

from executor.utils.slow_phase import SLOW_AFTER_S, announced_if_slow

logger = logging.getLogger(__name__)

# Seconds of building after which the console says the kernels are being compiled.
BUILD_NOTICE_AFTER_S = SLOW_AFTER_S
# Age past which torch's build lock is taken for one a killed build left (a build takes about a minute).
STALE_BUILD_LOCK_S = 600.0

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "paged_decode_attention.cpp",
    "amx_decode_attention.cpp",
    "paged_prefill_attention.cpp",
    "fused_elementwise.cpp",
    "kv_cache_write.cpp",
    "packed_linear.cpp",
    "int8_quant.cpp",
    "int8_linear.cpp",
    "wna16_linear.cpp",
    "amx_linear.cpp",
    "argmax_rows.cpp",
)
_DECLARATIONS = """
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t sliding_window,
    c10::optional<torch::Tensor> sinks, c10::optional<torch::Tensor> key_scale,
    c10::optional<torch::Tensor> value_scale, c10::optional<torch::Tensor> rows_per_request, bool allow_amx);
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
    torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_ends,
    torch::Tensor seq_lens, double scale, int64_t sliding_window, c10::optional<torch::Tensor> sinks,
    c10::optional<torch::Tensor> key_scale, c10::optional<torch::Tensor> value_scale);
torch::Tensor fused_rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
    double eps);
torch::Tensor fused_silu_and_mul(torch::Tensor x);
std::vector<torch::Tensor> fused_apply_rotary(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
    torch::Tensor sin);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor slot_mapping, c10::optional<torch::Tensor> key_scale, c10::optional<torch::Tensor> value_scale);
void write_latent_cache(torch::Tensor latent, torch::Tensor latent_cache, torch::Tensor slot_mapping,
    c10::optional<torch::Tensor> latent_scale);
torch::Tensor pack_linear_weight(torch::Tensor weight, int64_t width);
std::vector<torch::Tensor> quantize_int8_per_token(torch::Tensor x);
torch::Tensor int8_rescale(torch::Tensor accumulated, torch::Tensor x_scale, torch::Tensor w_scale,
    c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> pack_int8_weight(torch::Tensor weight);
torch::Tensor int8_linear_forward(torch::Tensor x, torch::Tensor packed, torch::Tensor compensation,
    torch::Tensor w_scale, c10::optional<torch::Tensor> input_scale, c10::optional<torch::Tensor> bias,
    int64_t out_features);
std::vector<torch::Tensor> pack_wna16_weight(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
    int64_t bits);
torch::Tensor wna16_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
    c10::optional<torch::Tensor> bias, int64_t bits, int64_t out_features);
torch::Tensor wna16_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
    int64_t out_features);
bool amx_available();
bool amx_decode_attention_fits(int64_t head_dim, int64_t block_size);
torch::Tensor pack_amx_weight(torch::Tensor weight);
torch::Tensor argmax_rows(torch::Tensor scores, bool allow_avx512);
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
    "quantize_int8_per_token",
    "int8_rescale",
    "pack_int8_weight",
    "int8_linear_forward",
    "pack_wna16_weight",
    "wna16_linear",
    "wna16_dequantize",
    "amx_available",
    "amx_decode_attention_fits",
    "pack_amx_weight",
    "argmax_rows",
)


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


def build_name(flags: list[str], sources: list[str]) -> str:
    """The extension's name, and so its build folder: one per vector flags and source text (headers
    included), so that an edited kernel is built afresh and checkouts with different kernels never
    rebuild each other's."""
    digest = hashlib.sha256("\0".join([*flags, *sources]).encode()).hexdigest()[:12]
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
    """The built module of every kernel, or None (and a warning, once) where it cannot be built; the
    CPU backend asks once, when it is made (ops/backend.py)."""
    from torch.utils.cpp_extension import load_inline  # imports setuptools: only when a kernel is wanted

    flags = vector_flags()
    # A cached build loads in well under a second; a first build compiles for about a minute, which
    # a silent console would pass off as a hang.
    building = "building the CPU kernels (ops/csrc, first use on this machine: about a minute; cached after)"
    try:
        with announced_if_slow(logger, building, BUILD_NOTICE_AFTER_S):
            sources = [_DECLARATIONS, *((CSRC / source).read_text() for source in SOURCES)]
            # Keyed by the sources too: checkouts of other versions never load each other's builds.
            headers = [header.read_text() for header in sorted(CSRC.glob("*.h"))]  # #included: unseen by the loader
            name = build_name(flags, sources + headers)
            clear_stale_build_lock(name)
            return load_inline(
                name=name,
                cpp_sources=sources,
                functions=list(FUNCTIONS),
                extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", *flags],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
            )
    except Exception as exc:  # no compiler, missing headers: the reference still works
        logger.warning("CPU kernels unavailable (%s); using the torch reference", exc)
        return None
