"""KVCacheManager: the scheduler's single door to the paged KV cache.

It speaks in requests and tokens, holds one SingleTypeKVCacheManager per cache group (all drawing
on one BlockPool), checks that every group can allocate before any does, and answers None (not an
exception) when the pool is short so the scheduler can wait or preempt.

Layout of one request's blocks in one group (block_size 4, 10 tokens computed, 3 new, 2 lookahead):

    | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 n0 n1 | n2 d0 d1 -- |
      block a       block b       block c       new block d

allocate_slots(request, 3, num_lookahead_tokens=2) hands out block d only; slots for n0..n2 (and
the draft tokens d0, d1 a verify step writes) follow from the table.
"""

from __future__ import annotations

from executor.core.kv_cache.block_pool import BlockPool
from executor.core.kv_cache.single_type_manager import SingleTypeKVCacheManager, manager_for
from executor.core.types_.kv_cache_spec import KVCacheSpec
from executor.core.types_.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, group_specs: list[KVCacheSpec]) -> None:
        assert group_specs, "a KV cache needs at least one cache group"
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_for(spec, self.block_pool, block_size) for spec in group_specs
        ]

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request holding `num_tokens` tokens needs across all cache groups."""
        return sum(manager.num_blocks_for_tokens(num_tokens) for manager in self.managers)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens of `request`, plus `num_lookahead_tokens`
        draft tokens a verify step will write.

        Returns the newly allocated block ids per cache group (possibly empty lists), or None when
        the pool cannot supply them all; in that case nothing is allocated.
        """
        total_tokens = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = [m.get_num_blocks_to_allocate(request.request_id, total_tokens) for m in self.managers]
        if sum(needed) > self.block_pool.num_free_blocks:
            return None
        return [m.allocate_new_blocks(request.request_id, total_tokens) for m in self.managers]

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's row of each group's block table."""
        return [manager.get_block_ids(request_id) for manager in self.managers]

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)
