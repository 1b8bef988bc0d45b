"""What an attention-like layer stores in the paged KV cache, per token, and how long it keeps it.

The worker sizes and allocates the cache from these specs (bytes per block is a sum over them), and
layers with equal specs share one cache group: one block table, one SingleTypeKVCacheManager. An
int8 cache (C8, `kv_scheme`) stores int8 values, plus, when its scales are dynamic, one fp32 scale
per token and KV head beside them (`<name>_scale`); static scales are layer parameters instead.

A recurrent spec (linear attention: a delta-rule or similar recurrence) stores no tensor per
token: its tensors (a short-convolution state, a recurrent state) are per request, of a fixed size
whatever the sequence's length, held in state slots rather than blocks (RecurrentStateManager).
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
    RECURRENT = "recurrent"  # a fixed-size state per request (linear attention), no tensor per token


class TPSplit(str, enum.Enum):
    """How attention tensor parallelism splits a cache tensor over a group's ranks, which is what a
    prefill instance of another layout needs to join its shards (online/disagg/kv_copy.py)."""

    HEADS = "heads"  # the entry's first axis is the heads (K/V, a recurrent state's), in equal runs by rank
    WHOLE = "whole"  # every rank holds all of it (an MLA latent: one for every head)
    # one entry axis (tp_dim) holds runs (tp_segments, each rank's sizes) each split by rank apart:
    # a conv state's channels, q, k and v, rank r holding the r-th share of each
    SEGMENTS = "segments"
    OTHER = "other"  # split another way: not joined


@dataclass(frozen=True, slots=True)
class KVTensorSpec:
    """One named cache tensor: `shape` per entry (K and V: (num_kv_heads, head_dim); an MLA latent:
    (kv_lora_rank + qk_rope_head_dim,)), or per state slot in a recurrent spec (a conv state:
    (channels, kernel - 1); a recurrent state: (heads, key_dim, value_dim)). An entry is one token,
    or for a compressed cache one entry per `tokens_per_entry` tokens: a block of block_size tokens
    then holds block_size // tokens_per_entry entries, entry e of a block covering its tokens
    [e * tokens_per_entry, (e + 1) * tokens_per_entry)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_entry: int = 1
    tp_split: TPSplit = TPSplit.OTHER
    tp_dim: int = 0  # SEGMENTS: the entry axis the runs lie along
    tp_segments: tuple[int, ...] = ()  # SEGMENTS: the runs' sizes on this rank, in order

    def __post_init__(self) -> None:
        assert (self.tp_split is TPSplit.SEGMENTS) == bool(self.tp_segments), (
            f"KV cache tensor {self.name!r}: segment sizes go with a SEGMENTS split, and only with it"
        )
        assert not self.tp_segments or sum(self.tp_segments) == self.shape[self.tp_dim], (
            f"KV cache tensor {self.name!r}: segments {self.tp_segments} do not fill axis {self.tp_dim} of {self.shape}"
        )

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one entry (one token's, or one state slot's, tensor)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Rounded down for a compressed tensor (a log figure); bytes_per_block is exact."""
        return self.bytes_per_entry // self.tokens_per_entry

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.tokens_per_entry:
            raise ValueError(
                f"KV cache tensor {self.name!r} keeps one entry per {self.tokens_per_entry} tokens: "
                f"scheduler_config.block_size must be a multiple of it, got {block_size}"
            )
        return block_size // self.tokens_per_entry

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The allocated paged tensor: [num_blocks, entries per block, *shape]."""
        return (num_blocks, self.entries_per_block(block_size), *self.shape)


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
    def is_recurrent(self) -> bool:
        """Whether the spec's tensors are per request (state slots) rather than per token (blocks)."""
        return self.kind is AttentionKind.RECURRENT

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the paged pool: none for a recurrent spec (see bytes_per_slot)."""
        return 0 if self.is_recurrent else sum(tensor.bytes_per_token for tensor in self.tensors)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one state slot takes (a recurrent spec; 0 for paged ones)."""
        return sum(tensor.bytes_per_entry for tensor in self.tensors) if self.is_recurrent else 0

    def allocation_shape(
        self, tensor: KVTensorSpec, num_blocks: int, block_size: int, num_state_slots: int
    ) -> tuple[int, ...]:
        """The shape a layer's `tensor` is allocated with: [num_state_slots, *shape] in a recurrent
        spec, else the paged [num_blocks, entries per block, *shape]."""
        if self.is_recurrent:
            return (num_state_slots, *tensor.shape)
        return tensor.cache_shape(num_blocks, block_size)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id takes in the paged pool (none for a recurrent spec)."""
        if self.is_recurrent:
            return 0
        return sum(tensor.entries_per_block(block_size) * tensor.bytes_per_entry for tensor in self.tensors)


def _stored(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, kv_scheme: KVCacheScheme | None, tp_split: TPSplit
) -> list[KVTensorSpec]:
    """One cache tensor of `shape` per token in `dtype`, or in int8 with its per-token-head scales
    (shape[:-1], fp32, split over the ranks as the values are) where `kv_scheme` is dynamic."""
    if kv_scheme is None:
        return [KVTensorSpec(name, shape, dtype, tp_split=tp_split)]
    values = KVTensorSpec(name, shape, torch.int8, tp_split=tp_split)
    if not kv_scheme.dynamic:
        return [values]
    return [values, KVTensorSpec(f"{name}_scale", shape[:-1], torch.float32, tp_split=tp_split)]


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
    tensors = [tensor for name in ("key", "value") for tensor in _stored(name, shape, dtype, kv_scheme, TPSplit.HEADS)]
    return KVCacheSpec(tuple(tensors), kind, sliding_window)


def mla_spec(
    kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype, kv_scheme: KVCacheScheme | None = None
) -> KVCacheSpec:
    """Multi-head latent attention: one compressed latent per token, shared by every head (the
    kv_lora_rank part K and V are decompressed from, then the rotated rope key), kept for the
    whole sequence; int8 with `kv_scheme` (dynamic: one scale per token for the whole latent)."""
    latent = _stored("latent", (kv_lora_rank + qk_rope_head_dim,), dtype, kv_scheme, TPSplit.WHOLE)
    return KVCacheSpec(tuple(latent))


def recurrent_spec(*tensors: KVTensorSpec) -> KVCacheSpec:
    """Linear attention: named state tensors of a fixed shape per request (per state slot), kept from
    one step to the next and replaced as the request advances; no tensor per token."""
    return KVCacheSpec(tuple(tensors), AttentionKind.RECURRENT)


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
    index_key = _stored("index_key", (index_head_dim,), dtype, index_scheme, TPSplit.WHOLE)
    return KVCacheSpec(tensors + tuple(index_key))
