"""Attention over the paged KV cache: write this step's K/V, then attend through the block table.

Every layer that keeps K/V is a KVCacheLayer: it declares what it stores per token
(`kv_cache_spec`), and the worker, after sizing the cache from all the specs, hands it its tensors
and its cache group with `bind_kv_cache`. The tensors are not parameters. With a C8 scheme
(`set_kv_cache_scheme`, before the cache is sized) the layer stores int8 K/V: dynamic scales are
cache tensors beside them, static ones parameters `k_scale` / `v_scale` loaded from the checkpoint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError
from executor.types_.kv_cache_spec import KVCacheSpec, attention_spec
from executor.types_.quant_scheme import TENSOR, KVCacheScheme
from module.parallel_group import SINGLE, ParallelGroup
from module.weights import ShardId, load_shard
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend

STATIC_KV_SCALES = ("k_scale", "v_scale")  # compressed-tensors' names, on the checkpoint's attention module


class KVCacheLayer(nn.Module):
    """A layer with a paged KV cache of its own (standard attention, MLA, ...)."""

    kv_cache_group_id: int = -1
    kv_scheme: KVCacheScheme | None = None  # C8 where set: an int8 cache
    k_scale: torch.Tensor  # a static C8 scheme's scales (set_kv_cache_scheme)
    v_scale: torch.Tensor
    # writes its cache through ops.attention.metadata.cache_writes and attends through the block table, so a
    # context-parallel step works (docs/distributed.md); a layer with other caches does not say so
    context_parallel: bool = False

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def static_scale_shape(self) -> tuple[int, int]:
        """A static scale's shape, [rows, channels] of one cached token (every channel its own scale)."""
        raise NotImplementedError

    def set_kv_cache_scheme(self, scheme: KVCacheScheme) -> list[nn.Parameter]:
        """Store the cache in int8 by `scheme`; a static one adds the parameters k_scale and v_scale
        (fp32, per channel: a per-tensor checkpoint scale fills every channel), returned for the
        caller to register where the checkpoint names them."""
        self.kv_scheme = scheme
        if scheme.dynamic:
            return []
        params = []
        for name in STATIC_KV_SCALES:
            param = nn.Parameter(torch.ones(self.static_scale_shape(), dtype=torch.float32), requires_grad=False)
            param.weight_loader = functools.partial(load_static_kv_scale, strategy=scheme.strategy)  # type: ignore[attr-defined]
            self.register_parameter(name, param)
            params.append(param)
        return params

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        """`caches` maps each spec tensor's name to [num_blocks, block_size, *per-token shape]."""
        raise NotImplementedError

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """The tensors bound last, by spec tensor name (graph compilers pass them as inputs)."""
        raise NotImplementedError


def load_static_kv_scale(
    param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None, *, strategy: str
) -> None:
    """A checkpoint's k_scale / v_scale: one value (per tensor) or one per channel (Hkv * D, any shape)."""
    scale = materialize(loaded_weight).float()
    expected = 1 if strategy == TENSOR else param.numel()
    if scale.numel() != expected:
        raise WeightLoadError(
            f"a static per-{strategy} KV scale holds {expected} values, got shape {tuple(scale.shape)}"
        )
    param.data.copy_(scale.reshape(-1).expand(param.numel()).view(param.shape))


class Attention(KVCacheLayer):
    """Attention over the layer's own paged K/V: each step writes its K/V, then attends through the
    block table, both by the backend's attention (ops/attention/), which reads the scale, window,
    sinks, C8 scales and caches off this layer.

    With `sinks` (gpt-oss), a learned logit per query head joins every softmax denominator, so a head
    may put its weight on no token; the sinks are split over ranks with the heads."""

    context_parallel = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        *,
        sinks: bool = False,
        tp: ParallelGroup = SINGLE,
        backend: Backend,
    ) -> None:
        super().__init__()
        if sinks:
            backend.require(("paged_attention_with_sinks",), "attention with sinks")
        self.attention = backend.attention
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self.load_sinks  # type: ignore[attr-defined]
        self.cache_dtype = backend.dtype
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)
        self.scale_caches: dict[str, torch.Tensor] = {}  # a dynamic C8 cache's key_scale and value_scale

    def load_sinks(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: ShardId = None) -> None:
        load_shard(param.data, loaded_weight, 0, self.tp_rank, self.tp_size)

    def kv_cache_spec(self) -> KVCacheSpec:
        return attention_spec(self.num_kv_heads, self.head_dim, self.cache_dtype, self.sliding_window, self.kv_scheme)

    def static_scale_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.head_dim)

    def kv_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key_scale, value_scale): the scale caches (dynamic C8), the static scales, or None."""
        if self.kv_scheme is None:
            return None, None
        if self.kv_scheme.dynamic:
            return self.scale_caches["key_scale"], self.scale_caches["value_scale"]
        return self.k_scale, self.v_scale

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        key_cache, value_cache = caches["key"], caches["value"]
        self.scale_caches = {name: caches[name] for name in ("key_scale", "value_scale") if name in caches}
        expected = (self.num_kv_heads, self.head_dim)
        assert key_cache.shape[2:] == expected and value_cache.shape[2:] == expected, (
            f"KV cache must be [num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
        self.key_cache = key_cache
        self.value_cache = value_cache
        self.kv_cache_group_id = group_id

    def kv_caches(self) -> dict[str, torch.Tensor]:
        return {"key": self.key_cache, "value": self.value_cache, **self.scale_caches}

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]."""
        if self.kv_cache_group_id < 0:
            raise RuntimeError("Attention has no KV cache: the worker must call bind_kv_cache before forward")
        self.attention.write(self, key, value, forward_metadata)
        return self.attention.forward(self, query, key, value, forward_metadata)


class SharedKVAttention(nn.Module):
    """Attention over another layer's paged K/V (cross-layer KV sharing: Gemma 4's last
    num_kv_shared_layers layers). A class of its own because it is no KVCacheLayer: it declares no
    cache spec, so the worker sizes and allocates nothing for it, and it writes nothing; each step it
    reads its source's tensors through the block table of its source's cache group, with its source's
    window and scales and this step's K/V (which the source wrote, handed over by the model)."""

    sinks: torch.Tensor | None = None

    def __init__(
        self, num_heads: int, head_dim: int, scale: float, sliding_window: int | None = None, *, backend: Backend
    ) -> None:
        super().__init__()
        self.attention = backend.attention
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.source: KVSource | None = None

    def read_kv_of(self, layer: Attention) -> None:
        """Attend over `layer`'s cache from now on: the same head_dim and window, the query heads in
        groups over its KV heads."""
        assert layer.head_dim == self.head_dim and layer.sliding_window == self.sliding_window, (
            f"a KV-shared layer (head_dim {self.head_dim}, window {self.sliding_window}) cannot read a cache of "
            f"head_dim {layer.head_dim}, window {layer.sliding_window}"
        )
        assert self.num_heads % layer.num_kv_heads == 0, (
            f"{self.num_heads} query heads do not group over {layer.num_kv_heads} KV heads"
        )
        self.source = KVSource(layer)

    # the source's cache, group and scales: what the attention backend reads (ops/attention's PagedKVLayer)
    @property
    def key_cache(self) -> torch.Tensor:
        return self._source().key_cache

    @property
    def value_cache(self) -> torch.Tensor:
        return self._source().value_cache

    @property
    def kv_cache_group_id(self) -> int:
        return self._source().kv_cache_group_id

    def kv_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._source().kv_scales()

    def _source(self) -> Attention:
        assert self.source is not None
        return self.source.layer

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """query [T, H, D], the source's K/V of this step [T, Hkv, D] (already in its cache) -> [T, H, D]."""
        if self.source is None or self.source.layer.kv_cache_group_id < 0:
            raise RuntimeError(
                "SharedKVAttention reads no bound cache: link it (read_kv_of) to a layer the worker bound"
            )
        return self.attention.forward(self, query, key, value, forward_metadata)


@dataclass(frozen=True, eq=False)
class KVSource:
    """The layer whose cache a SharedKVAttention reads: a reference, not a submodule (its own decoder
    layer owns it, and the worker finds and binds it there)."""

    layer: Attention
