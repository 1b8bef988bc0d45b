"""Attention over the paged KV cache: write this step's K/V, then attend through the block table.

The cache tensors are not parameters: the worker sizes them after the model is loaded and binds
them to every Attention module with `bind_kv_cache`.
"""

from __future__ import annotations

import torch
from torch import nn

import ops
from executor.core.types_.forward_metadata import ForwardMetaData


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)

    def bind_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """Caches are [num_blocks, block_size, num_kv_heads, head_dim] in the model dtype."""
        expected = (self.num_kv_heads, self.head_dim)
        assert key_cache.shape[2:] == expected and value_cache.shape[2:] == expected, (
            f"KV cache must be [num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
        self.key_cache = key_cache
        self.value_cache = value_cache

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward_metadata: ForwardMetaData
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]."""
        if self.key_cache.numel() == 0:
            raise RuntimeError("Attention has no KV cache: the worker must call bind_kv_cache before forward")
        ops.write_kv_cache(key, value, self.key_cache, self.value_cache, forward_metadata.slot_mapping)
        return ops.paged_attention(query, self.key_cache, self.value_cache, forward_metadata, self.scale)
