"""SingleTypeKVCacheManager: the logical blocks of one cache group, per request.

It decides how many blocks a request needs for a number of tokens, keeps each request's block
list (its row of the group's block table), finds the request's cached prefix in its group and
caches the blocks it computes. The sliding-window manager also drops the blocks that fall wholly
out of the window while the request runs, and accepts a prefix hit where only the window's blocks
are still cached.
"""

from __future__ import annotations

from executor.core.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from executor.types_.block_hash import BlockHash
from executor.types_.kv_cache_spec import AttentionKind, KVCacheSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Base: blocks grow with the sequence; subclasses change what a request must keep."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, block_size: int, group_id: int) -> None:
        self.spec = spec
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of each request already cached

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        """Blocks still missing for the request to hold `num_tokens` tokens in all."""
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, self.num_blocks_for_tokens(num_tokens) - held)

    def has_state_room(self, request_id: str) -> bool:
        """Whether the request's per-request state (a recurrent group's slots) fits; paged groups keep none."""
        return True

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new_blocks = self.block_pool.get_new_blocks(self.get_num_blocks_to_allocate(request_id, num_tokens))
        self.req_to_blocks.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def _cached(self, block_hash: BlockHash) -> int | None:
        return self.block_pool.get_cached_block((self.group_id, block_hash))

    def find_cached_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """The request's row for its longest cached prefix of at most `max_blocks` blocks."""
        hits: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = self._cached(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def take_cached_blocks(self, request_id: str, block_ids: list[int]) -> None:
        """Start the request's row with blocks found in the cache (it holds none yet)."""
        assert request_id not in self.req_to_blocks, f"request {request_id} already holds blocks"
        self.block_pool.touch([block_id for block_id in block_ids if block_id != NULL_BLOCK_ID])
        self.req_to_blocks[request_id] = list(block_ids)
        self.num_cached_blocks[request_id] = len(block_ids)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later query can attend to (none, for full attention)."""

    def cache_blocks(self, request_id: str, block_hashes: list[BlockHash], num_full_blocks: int) -> None:
        """Cache the request's blocks [0, num_full_blocks), whose K/V are computed, by their hashes.

        Where another request computed the same block in the same step, the request switches to
        that cached copy and frees its own: from then on they share it.
        """
        blocks = self.req_to_blocks[request_id]
        first = self.num_cached_blocks.get(request_id, 0)
        for index in range(first, num_full_blocks):
            if blocks[index] == NULL_BLOCK_ID:
                continue
            key = (self.group_id, block_hashes[index])
            cached = self.block_pool.get_cached_block(key)
            if cached is None:
                self.block_pool.cache_block(blocks[index], key)
            elif cached != blocks[index]:
                self.block_pool.touch([cached])
                self.block_pool.free_blocks([blocks[index]])
                blocks[index] = cached
        self.num_cached_blocks[request_id] = max(first, num_full_blocks)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (slots of rejected draft tokens)."""
        blocks = self.req_to_blocks.get(request_id, [])
        keep = self.num_blocks_for_tokens(num_tokens)
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks([block_id for block_id in reversed(tail) if block_id != NULL_BLOCK_ID])

    def free(self, request_id: str) -> None:
        """Return the request's blocks, last block first, so its tail is evicted first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks([block_id for block_id in reversed(blocks) if block_id != NULL_BLOCK_ID])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention keeps every block of the sequence until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p sees keys p - window + 1 .. p, so blocks wholly before the oldest key
    a future query can see are freed (the null block takes their place in the row)."""

    @property
    def window(self) -> int:
        assert self.spec.sliding_window is not None
        return self.spec.sliding_window

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block holding a key that a query at position num_computed_tokens can see."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        for index in reversed(range(min(self._first_needed_block(num_computed_tokens), len(blocks)))):
            if blocks[index] == NULL_BLOCK_ID:
                break  # everything before was freed already
            self.block_pool.free_blocks([blocks[index]])
            blocks[index] = NULL_BLOCK_ID

    def find_cached_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """The longest prefix of at most `max_blocks` blocks whose window is cached: the blocks
        before the window may be gone (null in the row)."""
        for num_blocks in range(min(max_blocks, len(block_hashes)), 0, -1):
            first = self._first_needed_block(num_blocks * self.block_size)
            window_blocks = [self._cached(block_hash) for block_hash in block_hashes[first:num_blocks]]
            if None not in window_blocks:
                return [NULL_BLOCK_ID] * first + window_blocks  # type: ignore[list-item]
        return []


def manager_for(spec: KVCacheSpec, block_pool: BlockPool, block_size: int, group_id: int) -> SingleTypeKVCacheManager:
    manager_cls = SlidingWindowManager if spec.kind is AttentionKind.SLIDING_WINDOW else FullAttentionManager
    return manager_cls(spec, block_pool, block_size, group_id)
