"""How many KV blocks to allocate: an explicit count, or what the memory budget allows.

There is no point holding more than the worst case of a full batch (batch_size requests of
max_model_len tokens in every cache group), so the budget is capped there.
"""

from __future__ import annotations

from pathlib import Path


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the CPU platform can spend on the KV cache)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def plan_num_blocks(
    *,
    num_blocks: int,
    bytes_per_block: int,
    max_blocks_in_use: int,
    free_memory_bytes: int,
    mem_fraction_static: float,
) -> int:
    """`num_blocks` when set (> 0); else min(budget, the most a full batch can hold + the null block).

    `max_blocks_in_use` is batch_size x blocks per max_model_len request x cache groups; block 0,
    the null block, comes on top.
    """
    if num_blocks > 0:
        return num_blocks
    affordable = int(free_memory_bytes * mem_fraction_static) // bytes_per_block
    if affordable < 2:
        raise RuntimeError(
            f"no memory for the null block and one KV block ({bytes_per_block} bytes each): "
            f"{free_memory_bytes} bytes free x mem_fraction_static {mem_fraction_static}"
        )
    return min(max_blocks_in_use + 1, affordable)
