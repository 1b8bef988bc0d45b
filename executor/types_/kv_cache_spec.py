"""What an attention-like layer stores in the paged KV cache, per token, and how long it keeps it.

The worker sizes and allocates the cache from these specs (bytes per block is a sum over them), and
layers with equal specs share one cache group: one block table, one SingleTypeKVCacheManager.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


class AttentionKind(str, enum.Enum):
    FULL = "full"  # every token of the sequence stays in the cache
    SLIDING_WINDOW = "sliding_window"  # only the last `sliding_window` tokens are attended to


@dataclass(frozen=True, slots=True)
class KVTensorSpec:
    """One named cache tensor: `shape` per token (K and V: (num_kv_heads, head_dim); an MLA latent:
    (kv_lora_rank + qk_rope_head_dim,))."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    tensors: tuple[KVTensorSpec, ...]
    kind: AttentionKind = AttentionKind.FULL
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        assert self.tensors, "a KV cache spec stores at least one tensor"
        assert (self.kind is AttentionKind.SLIDING_WINDOW) == (self.sliding_window is not None), (
            "a sliding-window spec needs its window, and only it"
        )

    @property
    def bytes_per_token(self) -> int:
        return sum(tensor.bytes_per_token for tensor in self.tensors)

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


def attention_spec(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, sliding_window: int | None = None
) -> KVCacheSpec:
    """Standard attention: a key and a value of [num_kv_heads, head_dim] per token, kept for the
    whole sequence or, with `sliding_window`, for the window."""
    shape = (num_kv_heads, head_dim)
    kind = AttentionKind.FULL if sliding_window is None else AttentionKind.SLIDING_WINDOW
    return KVCacheSpec((KVTensorSpec("key", shape, dtype), KVTensorSpec("value", shape, dtype)), kind, sliding_window)


def mla_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    """Multi-head latent attention: one compressed latent per token, shared by every head (the
    kv_lora_rank part K and V are decompressed from, then the rotated rope key), kept for the
    whole sequence."""
    return KVCacheSpec((KVTensorSpec("latent", (kv_lora_rank + qk_rope_head_dim,), dtype),))
