"""BlockPool: the physical KV blocks of every cache group, their reference counts, the free queue
and the prefix cache.

Block 0 is the null block: never handed out, the place padded rows write to, and what a block
table holds where a request has no block (past its end, or before a sliding window).

A full block whose K/V have been computed is cached under its cache group and its BlockHash (its
tokens and the hash of the block before it). A freed block keeps its hash and joins the back of
the free queue, so it can be found again by a later request until it is evicted: taken from the
front of the queue for new data, when its hash is dropped. Freeing a request's blocks tail first
makes its last blocks go first, which keeps shared prefixes longest.
"""

from __future__ import annotations

from collections import OrderedDict

from executor.types_.block_hash import BlockHash

NULL_BLOCK_ID = 0


CacheKey = tuple[int, BlockHash]  # (cache group id, block hash): groups hold different K/V for one prefix


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs the null block and at least one more, got {num_blocks} blocks")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cache_keys: list[CacheKey | None] = [None] * num_blocks
        self.cached_blocks: dict[CacheKey, int] = {}
        # Free blocks, least recently freed first; an ordered dict so a cache hit can take one out.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_blocks))
        self.num_evictions = 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold K/V: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.num_used_blocks / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        return list(self._free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks for new data, each with a reference count of one; a cached
        block taken this way is evicted (its hash dropped)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        block_ids = [self._free_queue.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            assert self.ref_counts[block_id] == 0, f"block {block_id} in the free queue is still referenced"
            self._evict(block_id)
            self.ref_counts[block_id] = 1
        return block_ids

    def get_cached_block(self, key: CacheKey) -> int | None:
        return self.cached_blocks.get(key)

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference to each cached block a request reuses (out of the free queue if
        no one held it)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self.ref_counts[block_id] += 1

    def cache_block(self, block_id: int, key: CacheKey) -> None:
        """Record that `block_id` holds the computed K/V of `key` (which no block holds yet)."""
        assert key not in self.cached_blocks and self.cache_keys[block_id] is None, f"block {block_id} cached twice"
        self.cache_keys[block_id] = key
        self.cached_blocks[key] = block_id

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block with none left joins the back of the free
        queue, its hash kept until it is evicted."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK_ID, "the null block is never handed out, so never freed"
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_queue[block_id] = None

    def _evict(self, block_id: int) -> None:
        key = self.cache_keys[block_id]
        if key is None:
            return
        self.cache_keys[block_id] = None
        del self.cached_blocks[key]
        self.num_evictions += 1
