"""How many KV blocks to allocate: an explicit count, or what the memory budget allows.

There is no point holding more than the worst case of a full batch (batch_size requests of
max_model_len tokens), so the budget is capped there.
"""

from __future__ import annotations

from pathlib import Path

from executor.core.kv_cache import cdiv


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the CPU platform can spend on the KV cache)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def plan_num_blocks(
    *,
    num_blocks: int,
    block_size: int,
    bytes_per_block: int,
    batch_size: int,
    max_model_len: int,
    free_memory_bytes: int,
    mem_fraction_static: float,
) -> int:
    """`num_blocks` when set (> 0); else min(budget, full-batch worst case), at least one."""
    if num_blocks > 0:
        return num_blocks
    worst_case = batch_size * cdiv(max_model_len, block_size)
    affordable = int(free_memory_bytes * mem_fraction_static) // bytes_per_block
    if affordable < 1:
        raise RuntimeError(
            f"no memory for even one KV block ({bytes_per_block} bytes): "
            f"{free_memory_bytes} bytes free x mem_fraction_static {mem_fraction_static}"
        )
    return min(worst_case, affordable)
