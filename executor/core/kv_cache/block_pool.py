"""BlockPool: the physical KV blocks, their reference counts and the free queue.

The free queue is FIFO, so a block freed long ago is reused first; prefix caching will keep a
hash -> block map here and evict from the front of this queue.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_blocks

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
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_queue.append(block_id)
