"""KVCacheManager: the scheduler's single door to the paged KV cache.

It speaks in requests and tokens, checks that every attention type can allocate before any
does, and answers None (not an exception) when the pool is short so the scheduler can wait.

Layout of one request's blocks (block_size 4, 10 tokens computed, 3 new):

    | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 n0 n1 | n2 -- -- -- |
      block a       block b       block c       new block d

allocate_slots(request, 3) hands out block d only; slots for n0..n2 follow from the table.
"""

from __future__ import annotations

from executor.core.kv_cache.block_pool import BlockPool
from executor.core.kv_cache.single_type_manager import FullAttentionManager, SingleTypeKVCacheManager
from executor.core.types_.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        # One manager per attention type (KV cache group); models with sliding-window layers add one.
        self.managers: list[SingleTypeKVCacheManager] = [FullAttentionManager(self.block_pool, block_size)]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request holding `num_tokens` tokens needs across all attention types."""
        return sum(manager.num_blocks_for_tokens(num_tokens) for manager in self.managers)

    def num_blocks_held(self, request_id: str) -> int:
        return sum(len(manager.get_block_ids(request_id)) for manager in self.managers)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Returns the newly allocated block ids per attention type (possibly empty lists), or None
        when the pool cannot supply them all; in that case nothing is allocated.
        """
        total_tokens = request.num_computed_tokens + num_new_tokens
        needed = [m.get_num_blocks_to_allocate(request.request_id, total_tokens) for m in self.managers]
        if sum(needed) > self.block_pool.num_free_blocks:
            return None
        return [m.allocate_new_blocks(request.request_id, total_tokens) for m in self.managers]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's row of the block table (full-attention group)."""
        return self.managers[0].get_block_ids(request_id)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)
