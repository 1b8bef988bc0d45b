"""What an attention-like layer stores in the paged KV cache, per token, and how long it keeps it.

The worker sizes and allocates the cache from these specs (bytes per block is a sum over them), and
layers with equal specs share one cache group: one block table, one SingleTypeKVCacheManager. An
int8 cache (C8, `kv_scheme`) stores int8 values, plus, when its scales are dynamic, one fp32 scale
per token and KV head beside them (`<name>_scale`); static scales are layer parameters instead.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from executor.types_.quant_scheme import KVCacheScheme


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


def _stored(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, kv_scheme: KVCacheScheme | None
) -> list[KVTensorSpec]:
    """One cache tensor of `shape` per token in `dtype`, or in int8 with its per-token-head scales
    (shape[:-1], fp32) where `kv_scheme` is dynamic."""
    if kv_scheme is None:
        return [KVTensorSpec(name, shape, dtype)]
    values = KVTensorSpec(name, shape, torch.int8)
    return [values, KVTensorSpec(f"{name}_scale", shape[:-1], torch.float32)] if kv_scheme.dynamic else [values]


def attention_spec(
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    kv_scheme: KVCacheScheme | None = None,
) -> KVCacheSpec:
    """Standard attention: a key and a value of [num_kv_heads, head_dim] per token, kept for the
    whole sequence or, with `sliding_window`, for the window; int8 with `kv_scheme`."""
    shape = (num_kv_heads, head_dim)
    kind = AttentionKind.FULL if sliding_window is None else AttentionKind.SLIDING_WINDOW
    tensors = _stored("key", shape, dtype, kv_scheme) + _stored("value", shape, dtype, kv_scheme)
    return KVCacheSpec(tuple(tensors), kind, sliding_window)


def mla_spec(
    kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype, kv_scheme: KVCacheScheme | None = None
) -> KVCacheSpec:
    """Multi-head latent attention: one compressed latent per token, shared by every head (the
    kv_lora_rank part K and V are decompressed from, then the rotated rope key), kept for the
    whole sequence; int8 with `kv_scheme` (dynamic: one scale per token for the whole latent)."""
    return KVCacheSpec(tuple(_stored("latent", (kv_lora_rank + qk_rope_head_dim,), dtype, kv_scheme)))


def dsa_spec(
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    index_head_dim: int | None,
    dtype: torch.dtype,
    kv_scheme: KVCacheScheme | None = None,
) -> KVCacheSpec:
    """MLA with sparse attention: the latent, and (for a layer that runs its own lightning
    indexer, `index_head_dim` not None) the indexer's key of index_head_dim per token. Under a dynamic
    C8 scheme both are int8 with one scale per token; a static scheme has no checkpoint scale for the
    indexer key, which then stays in `dtype`."""
    tensors = mla_spec(kv_lora_rank, qk_rope_head_dim, dtype, kv_scheme).tensors
    if index_head_dim is None:
        return KVCacheSpec(tensors)
    index_scheme = kv_scheme if kv_scheme is not None and kv_scheme.dynamic else None
    return KVCacheSpec(tensors + tuple(_stored("index_key", (index_head_dim,), dtype, index_scheme)))
