"""The CPU's attention backend: the C++ kernels of ops/csrc behind their shape guards, falling back to
the reference (ops/attention/reference.py) where a guard fails.

The decode kernel reads each request's slots in place instead of gathering a padded copy (an int8
cache dequantized as read); it is the op torch.ops.infer_recipes_cpu.paged_decode_attention,
declared once with its schema in ops/csrc/paged_decode_attention.cpp, so a compiled decode sees one
opaque call (its fake below). MLA's absorbed decode runs it too, over the latents as one KV head. Any
other step runs in one call of the prefill kernel, which takes the step's own K/V from the layer (from
an int8 cache, the cache); inside torch.compile, which cannot trace it, the reference's per-request
loop. The cache writes copy each new row straight to its slot (or quantize it into an int8 cache).
"""

from __future__ import annotations

from typing import Any

import torch

from ops.attention import PagedKVLayer
from ops.attention.metadata import TorchAttentionMetadata
from ops.attention.reference import ReferenceAttention, write_kv_cache, write_latent_cache
from ops.cpu import named
from ops.cpu_kernels import fake


@fake("paged_decode_attention")
def _(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(query)


class CpuAttention(ReferenceAttention):
    """The reference's attention with the C++ kernels of one built extension (`kernels`,
    torch.ops.infer_recipes_cpu)."""

    name = "cpu"

    def __init__(self, kernels: Any) -> None:
        super().__init__(kernels.paged_decode_attention)
        self.kernels = kernels

    def decode(
        self, layer: PagedKVLayer, query: torch.Tensor, block_table: torch.Tensor, metadata: TorchAttentionMetadata
    ) -> torch.Tensor:
        """`rows_per_request` ([1], None: 1) consecutive rows share the first one's block table (a verify
        step's tokens in a graph), so the kernel reads their K/V once."""
        assert metadata.seq_lens is not None
        caches = (layer.key_cache, layer.value_cache, block_table, metadata.seq_lens)
        options = (layer.scale, layer.sliding_window or 0, layer.sinks, *layer.kv_scales(), metadata.rows_per_request)
        return self.decode_attention(query, *caches, *options)

    def prefill(
        self,
        layer: PagedKVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        block_table: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().prefill(layer, query, key, value, block_table, metadata)
        caches = (layer.key_cache, layer.value_cache, block_table)
        lengths = (metadata.query_ends, metadata.seq_lens)
        options = (layer.scale, layer.sliding_window or 0, layer.sinks, *layer.kv_scales())
        return named("paged_prefill_attention", self.kernels.paged_prefill_attention)(
            query, key, value, *caches, *lengths, *options
        )

    def write_kv_cache(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """One memcpy per row (any dtype), or its quantization into an int8 cache; raises on a slot
        outside the cache."""
        caches, scales = (layer.key_cache, layer.value_cache), layer.kv_scales()
        if _can_write(slots, *caches, *scales):
            named("write_kv_cache", self.kernels.write_kv_cache)(key, value, *caches, slots, *scales)
            return
        write_kv_cache(key, value, *caches, slots, *scales)

    def write_latent_cache(
        self,
        latent: torch.Tensor,
        latent_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        latent_scale: torch.Tensor | None = None,
    ) -> None:
        if _can_write(slot_mapping, latent_cache, latent_scale):
            kernel = named("write_latent_cache", self.kernels.write_latent_cache)
            kernel(latent, latent_cache, slot_mapping, latent_scale)
            return
        write_latent_cache(latent, latent_cache, slot_mapping, latent_scale)


def _can_write(slot_mapping: torch.Tensor, *caches: torch.Tensor | None) -> bool:
    """The C++ cache writes take contiguous caches (and scales, where given) and int64 slots, and no
    compiler traces them."""
    return (
        slot_mapping.dtype == torch.int64
        and all(cache is None or cache.is_contiguous() for cache in caches)
        and not torch.compiler.is_compiling()
    )
