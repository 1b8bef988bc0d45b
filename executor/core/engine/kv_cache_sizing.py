"""How many KV blocks to allocate, and binding them: an explicit count, or what the memory left
after the weights, a warm-up on a small probe cache and the graphs allows.

There is no point holding more than the worst case of a full batch (batch_size requests of
max_model_len tokens in every cache group), so the budget is capped there. Every rank sizes the
smallest pool any rank can hold, so that all ranks schedule alike.

Recurrent groups (linear attention) hold state slots per running request instead of blocks: 1 +
batch_size x (1 + k) slots (slot 0 the null slot; k draft tokens per verify step, 0 without
speculative decoding), whose bytes come off the budget before the blocks are counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.comm_manager import CommManager
from executor.core.kv_cache import KVCacheManager, cdiv
from executor.core.model_worker import ModelWorker
from executor.platform import Platform

logger = logging.getLogger(__name__)

WARM_UP_PROMPT_TOKENS = 16


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the CPU platform can spend on the KV cache)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def check_room_for_one_request(
    num_blocks: int, budget: str, block_size: int, max_model_len: int, num_paged_groups: int, source: str
) -> None:
    """The one rule every KV pool keeps, checked from the config before a model loads (a pool of an
    explicit size, one cache group: executor/offline/preflight.py) and here once the groups are
    known: beside the null block (block 0), room for one request of max_model_len in every paged
    cache group. `budget` says where num_blocks came from."""
    needed_blocks = num_paged_groups * cdiv(max_model_len, block_size)
    if num_blocks - 1 < needed_blocks:
        raise ConfigError(
            f"the KV cache budget ({budget}: {num_blocks - 1} usable blocks of {block_size} tokens) cannot "
            f"hold one request of max_model_len {max_model_len}, which needs {needed_blocks} blocks "
            f"over {num_paged_groups} cache group(s); raise the budget or lower scheduler_config.max_model_len "
            f"({source})"
        )


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


def state_slots_per_request(config: InferenceConfig) -> int:
    """A request's state slots in each recurrent group: 1, or 1 + k with k draft tokens per verify step
    (the state after each of its positions is kept until the accepted prefix is known)."""
    return 1 + config.speculation[1]


def num_state_slots(worker: ModelWorker, config: InferenceConfig, max_running_requests: int) -> int:
    """State slots of each recurrent group: the null slot and each running request's; 0 without any."""
    return 1 + max_running_requests * state_slots_per_request(config) if worker.state_groups() else 0


def bind_kv_cache(
    worker: ModelWorker, config: InferenceConfig, num_blocks: int, max_running_requests: int = 0
) -> KVCacheManager | None:
    """Allocate and bind `num_blocks` blocks and the state slots of `max_running_requests` (none:
    release the cache) and a manager over them."""
    sched = config.scheduler_config
    slots = num_state_slots(worker, config, max_running_requests) if num_blocks else 0
    worker.init_kv_cache(num_blocks, sched.block_size, slots)
    if not num_blocks:
        return None
    specs = [group.spec for group in worker.kv_cache_groups]
    return KVCacheManager(
        num_blocks,
        sched.block_size,
        specs,
        sched.enable_prefix_caching,
        num_state_slots=slots,
        state_slots_per_request=state_slots_per_request(config),
    )


def size_kv_cache(
    config: InferenceConfig,
    worker: ModelWorker,
    platform: Platform,
    comm: CommManager,
    max_model_len: int,
    warm_up: Callable[[KVCacheManager, int], None],
    measure_graph_memory: Callable[[], int],
) -> KVCacheManager:
    """Warm up (`warm_up(probe manager, prompt tokens)`) on a small probe cache, then size the real
    one from the memory left after the weights, the warm-up and the graphs (device memory on
    CUDA/NPU, MemAvailable on CPU), or from scheduler_config.num_blocks."""
    sched = config.scheduler_config
    # groups of blocks; a recurrent group holds state slots instead (at least one paged group is assumed)
    num_paged_groups = max(1, len(worker.kv_cache_groups) - len(worker.state_groups()))
    max_blocks_per_request = cdiv(max_model_len, sched.block_size)
    warm_up_tokens = min(WARM_UP_PROMPT_TOKENS, max_model_len - 1)
    # room for the prompt and the two tokens the warm-up request generates
    probe = bind_kv_cache(
        worker, config, num_paged_groups * cdiv(warm_up_tokens + 2, sched.block_size) + 1, max_running_requests=1
    )
    assert probe is not None
    warm_up(probe, warm_up_tokens)
    graph_bytes = measure_graph_memory()
    bind_kv_cache(worker, config, 0)  # drop the probe before measuring what the real cache may take
    memory = platform.memory_info_bytes()
    free_bytes = (memory[0] - graph_bytes) if memory is not None else host_available_bytes()
    state_bytes = num_state_slots(worker, config, sched.batch_size) * worker.state_bytes_per_slot()
    num_blocks = plan_num_blocks(
        num_blocks=sched.num_blocks,
        bytes_per_block=worker.kv_cache_bytes_per_block(sched.block_size),
        max_blocks_in_use=sched.batch_size * max_blocks_per_request * num_paged_groups,
        # the states take their bytes out of the fraction the cache may use: free x fraction - states
        free_memory_bytes=max(0, free_bytes - int(state_bytes / sched.mem_fraction_static)),
        mem_fraction_static=sched.mem_fraction_static,
    )
    num_blocks = comm.min_over_world(num_blocks)
    blocks_per_request = num_paged_groups * max_blocks_per_request
    budget = (
        f"num_blocks {sched.num_blocks}"
        if sched.num_blocks
        else f"{free_bytes / 2**30:.2f} GiB free x mem_fraction_static {sched.mem_fraction_static}"
    )
    check_room_for_one_request(num_blocks, budget, sched.block_size, max_model_len, num_paged_groups, config.source)
    manager = bind_kv_cache(worker, config, num_blocks, max_running_requests=sched.batch_size)
    assert manager is not None
    _log_kv_cache(worker, sched.block_size, num_blocks, blocks_per_request, max_model_len, num_paged_groups)
    if manager.prefix_caching_refusal is not None:
        logger.warning("%s (scheduler_config.enable_prefix_caching is true)", manager.prefix_caching_refusal)
    if state_bytes:
        logger.info(
            "recurrent states: %d slots (slot 0 the null slot) of %d B each, %.1f MiB",
            num_state_slots(worker, config, sched.batch_size),
            worker.state_bytes_per_slot(),
            state_bytes / 2**20,
        )
    return manager


def _log_kv_cache(
    worker: ModelWorker,
    block_size: int,
    num_blocks: int,
    blocks_per_request: int,
    max_model_len: int,
    num_paged_groups: int,
) -> None:
    per_group = ", ".join(
        f"group {i} ({group.spec.kind.value}, {len(group.layer_names)} layers): "
        + (
            f"{group.spec.bytes_per_slot * len(group.layer_names)} B/request"
            if group.spec.is_recurrent
            else f"{group.spec.bytes_per_token * len(group.layer_names)} B/token"
        )
        for i, group in enumerate(worker.kv_cache_groups)
    )
    total_mib = num_blocks * worker.kv_cache_bytes_per_block(block_size) / 2**20
    logger.info(
        "KV cache: %d blocks of %d tokens (block 0 reserved), %.0f MiB; %s; holds %d tokens per group, "
        "%d request(s) of max_model_len %d at once",
        num_blocks,
        block_size,
        total_mib,
        per_group,
        (num_blocks - 1) // num_paged_groups * block_size,
        (num_blocks - 1) // blocks_per_request,
        max_model_len,
    )
