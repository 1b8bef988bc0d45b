"""Paged KV cache bookkeeping: KVCacheManager -> SingleTypeKVCacheManager (per cache group) -> BlockPool."""

from executor.core.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from executor.core.kv_cache.kv_cache_manager import CacheLayout, KVCacheManager
from executor.core.kv_cache.recurrent_state_manager import NULL_STATE_SLOT, RecurrentStateManager, StateSlotPool
from executor.core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)

__all__ = [
    "NULL_BLOCK_ID",
    "NULL_STATE_SLOT",
    "BlockPool",
    "CacheLayout",
    "FullAttentionManager",
    "KVCacheManager",
    "RecurrentStateManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "StateSlotPool",
    "cdiv",
]
