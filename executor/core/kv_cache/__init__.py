"""Paged KV cache bookkeeping: KVCacheManager -> SingleTypeKVCacheManager -> BlockPool."""

from executor.core.kv_cache.block_pool import BlockPool
from executor.core.kv_cache.kv_cache_manager import KVCacheManager
from executor.core.kv_cache.single_type_manager import FullAttentionManager, SingleTypeKVCacheManager, cdiv

__all__ = ["BlockPool", "FullAttentionManager", "KVCacheManager", "SingleTypeKVCacheManager", "cdiv"]
