"""A stand-in attention layer for calling an attention backend (ops/attention/) on tensors made by a
test: the caches, scale, window, sinks and C8 scales it reads off the layer, given directly."""

from __future__ import annotations

import dataclasses

import torch

from ops.attention.metadata import CacheGroupTables, ForwardMetaData


@dataclasses.dataclass
class PagedLayer:
    """What an attention backend reads off a paged K/V layer (ops/attention's PagedKVLayer)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    scale: float
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    kv_cache_group_id: int = 0

    def kv_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.key_scale, self.value_scale


def attend(
    attention: object,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    metadata: ForwardMetaData,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention`.forward for a layer of these caches and options, reading through `block_table`."""
    groups = [CacheGroupTables(block_table, slot_mapping=torch.empty(0, dtype=torch.int64))]
    layer = PagedLayer(key_cache, value_cache, scale, sliding_window, sinks, key_scale, value_scale)
    return attention.forward(layer, query, key, value, dataclasses.replace(metadata, groups=groups))


def write_kv(attention: object, key: torch.Tensor, value: torch.Tensor, *cache_args: torch.Tensor | None) -> None:
    """`attention`.write_kv_cache of key/value [t, Hkv, D] for a layer of the caches, given as
    ops/attention/reference.py's write_kv_cache takes them after key and value: key_cache,
    value_cache, slot_mapping, and a C8 cache's key_scale and value_scale."""
    key_cache, value_cache, slot_mapping, *scales = cache_args
    layer = PagedLayer(key_cache, value_cache, 1.0, None, None, *scales)
    attention.write_kv_cache(layer, key, value, slot_mapping)
