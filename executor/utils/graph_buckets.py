"""Graph buckets: the decode batch sizes a graph is compiled or captured for.

A graph has static shapes, so a decode step of n rows runs in the smallest bucket that holds n,
padded with rows that touch only the null block. Few buckets keep warm-up short; the ones below
keep the padding under 2x for small batches and under 16 rows past them, as cann-recipes and
vLLM's CUDA-graph sizes do. With speculative decoding each batch size has a second bucket whose
requests hold 1 + k tokens each (a verify step), as cann-recipes' decode graphs hold next_n + 1.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Bucket:
    """A graph's shape: `num_rows` requests of `tokens_per_row` tokens each (1 in a decode step,
    1 + k in a verify step)."""

    num_rows: int
    tokens_per_row: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.tokens_per_row

    @property
    def name(self) -> str:
        """`4` for a decode bucket (the names the logs, summaries and compile caches always had), `4x3`
        for 4 requests of 3 tokens."""
        return str(self.num_rows) if self.tokens_per_row == 1 else f"{self.num_rows}x{self.tokens_per_row}"


SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STRIDE = 16


def default_buckets(batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 below batch_size, then batch_size itself: the largest
    step the scheduler can make always has a bucket, with no rows padded past it."""
    buckets = [size for size in SMALL_BUCKETS if size < batch_size]
    buckets += range(BUCKET_STRIDE, batch_size, BUCKET_STRIDE)
    return [*buckets, batch_size]


def resolve_buckets(configured: Sequence[int], batch_size: int) -> list[int]:
    """The configured list (sorted, duplicates dropped), or the default one for `batch_size`."""
    return sorted(set(configured)) if configured else default_buckets(batch_size)


def pick_bucket(num_rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_rows` rows, or None when the largest is too small."""
    index = bisect.bisect_left(buckets, num_rows)
    return buckets[index] if index < len(buckets) else None
