"""Paged KV cache bookkeeping: KVCacheManager -> SingleTypeKVCacheManager (per cache group) -> BlockPool."""

from executor.core.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from executor.core.kv_cache.kv_cache_manager import KVCacheManager
from executor.core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)

__all__ = [
    "NULL_BLOCK_ID",
    "BlockPool",
    "FullAttentionManager",
    "KVCacheManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "cdiv",
]
