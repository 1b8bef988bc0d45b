"""Attention over the paged KV cache: write this step's K/V, then attend through the block table.

Every layer that keeps K/V is a KVCacheLayer: it declares what it stores per token
(`kv_cache_spec`), and the worker, after sizing the cache from all the specs, hands it its tensors
and its cache group with `bind_kv_cache`. The tensors are not parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.types_.kv_cache_spec import KVCacheSpec, attention_spec
from executor.types_.model_inputs import ForwardMetaData
from module.parallel_group import SINGLE, ParallelGroup
from module.weights import LoadedWeight, ShardId, load_shard
from ops.backend import Backend


class KVCacheLayer(nn.Module):
    """A layer with a paged KV cache of its own (standard attention, MLA, ...)."""

    kv_cache_group_id: int = -1

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        """`caches` maps each spec tensor's name to [num_blocks, block_size, *per-token shape]."""
        raise NotImplementedError

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """The tensors bound last, by spec tensor name (graph compilers pass them as inputs)."""
        raise NotImplementedError


class Attention(KVCacheLayer):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        *,
        backend: Backend,
    ) -> None:
        super().__init__()
        self.ops = backend
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.cache_dtype = torch.get_default_dtype()  # the worker builds the model under its dtype
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)

    def kv_cache_spec(self) -> KVCacheSpec:
        return attention_spec(self.num_kv_heads, self.head_dim, self.cache_dtype, self.sliding_window)

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        key_cache, value_cache = caches["key"], caches["value"]
        expected = (self.num_kv_heads, self.head_dim)
        assert key_cache.shape[2:] == expected and value_cache.shape[2:] == expected, (
            f"KV cache must be [num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
        self.key_cache = key_cache
        self.value_cache = value_cache
        self.kv_cache_group_id = group_id

    def kv_caches(self) -> dict[str, torch.Tensor]:
        return {"key": self.key_cache, "value": self.value_cache}

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]."""
        if self.kv_cache_group_id < 0:
            raise RuntimeError("Attention has no KV cache: the worker must call bind_kv_cache before forward")
        tables = forward_metadata.groups[self.kv_cache_group_id]
        self.ops.write_kv_cache(key, value, self.key_cache, self.value_cache, tables.slot_mapping)
        return self.attend(query, key, value, tables.block_table, forward_metadata)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        block_table: torch.Tensor,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """query [T, H, D] over the cache, this step's K/V [T, Hkv, D] already written -> [T, H, D].
        The op takes the step's K/V too, so that a prefill need not read them back from the cache."""
        return self.ops.paged_attention(
            query,
            key,
            value,
            self.key_cache,
            self.value_cache,
            block_table,
            forward_metadata,
            self.scale,
            self.sliding_window,
        )


class SinkAttention(Attention):
    """Attention with a learned sink logit per query head in every softmax denominator (gpt-oss),
    so a head may put its weight on no token. The sinks are split over ranks with the heads."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        tp: ParallelGroup = SINGLE,
        *,
        backend: Backend,
    ) -> None:
        backend.require(("paged_attention_with_sinks",), "attention with sinks")
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, backend=backend)
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.sinks.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        load_shard(param.data, loaded_weight, 0, self.tp_rank, self.tp_size)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        block_table: torch.Tensor,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        return self.ops.paged_attention_with_sinks(
            query,
            key,
            value,
            self.key_cache,
            self.value_cache,
            block_table,
            forward_metadata,
            self.scale,
            self.sinks,
            self.sliding_window,
        )
