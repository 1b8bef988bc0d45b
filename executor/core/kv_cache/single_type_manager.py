"""SingleTypeKVCacheManager: the logical blocks of one cache group, per request.

It decides how many blocks a request needs for a number of tokens and keeps each request's
block list (its row of the group's block table). The sliding-window manager will also drop the
blocks that fall wholly outside the window; for now it keeps them, as the full manager does.
"""

from __future__ import annotations

from executor.core.kv_cache.block_pool import BlockPool
from executor.core.types_.kv_cache_spec import AttentionKind, KVCacheSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Base: blocks grow with the sequence; subclasses change what a request must keep."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, block_size: int) -> None:
        self.spec = spec
        self.block_pool = block_pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[int]] = {}

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        """Blocks still missing for the request to hold `num_tokens` tokens in all."""
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, self.num_blocks_for_tokens(num_tokens) - held)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new_blocks = self.block_pool.get_new_blocks(self.get_num_blocks_to_allocate(request_id, num_tokens))
        self.req_to_blocks.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return the request's blocks, last block first, so its tail is reused last."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(list(reversed(blocks)))


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention keeps every block of the sequence until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention. It keeps every block for now (correct, not yet frugal): freeing the
    blocks that fall out of the window is the KV cache issue's work."""


def manager_for(spec: KVCacheSpec, block_pool: BlockPool, block_size: int) -> SingleTypeKVCacheManager:
    manager_cls = SlidingWindowManager if spec.kind is AttentionKind.SLIDING_WINDOW else FullAttentionManager
    return manager_cls(spec, block_pool, block_size)
