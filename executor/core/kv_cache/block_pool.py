"""BlockPool: the physical KV blocks of every cache group, their reference counts and the free queue.

Block 0 is the null block: never handed out, the place padded rows write to, and what a block
table holds past a request's real blocks. The free queue is FIFO, so a block freed long ago is
reused first; prefix caching will keep a hash -> block map here and evict from its front.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs the null block and at least one more, got {num_blocks} blocks")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_queue: deque[int] = deque(range(NULL_BLOCK_ID + 1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold K/V: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with a reference count of one."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        block_ids = [self._free_queue.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            assert self.ref_counts[block_id] == 0, f"block {block_id} in the free queue is still referenced"
            self.ref_counts[block_id] = 1
        return block_ids

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block with none left returns to the free queue."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK_ID, "the null block is never handed out, so never freed"
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_queue.append(block_id)
