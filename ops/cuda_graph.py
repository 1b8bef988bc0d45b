"""The CUDA graph backend's own forms: what a captured graph must do differently from eager CUDA.

A captured graph may read nothing on the host (the capture would sync, and the replay would keep
the first step's value), and it is replayed for every later length; so its decode attention
gathers the block table's whole capacity instead of reading the step's longest length.
"""

from __future__ import annotations

import torch

from ops import torch_ref
from ops.attention_metadata import TorchAttentionMetadata


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch_ref.paged_decode_attention over the table's capacity (positions past each length are masked)."""
    capacity = block_table.shape[1] * key_cache.shape[1]
    return torch_ref.gathered_decode_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window, sinks, capacity
    )


def paged_attention(*args: object, **kwargs: object) -> torch.Tensor:
    """torch_ref.paged_attention with the capacity decode."""
    return torch_ref.paged_attention(*args, **kwargs, decode_attention=paged_decode_attention)


def paged_attention_with_sinks(*args: object, **kwargs: object) -> torch.Tensor:
    """torch_ref.paged_attention_with_sinks with the capacity decode."""
    return torch_ref.paged_attention_with_sinks(*args, **kwargs, decode_attention=paged_decode_attention)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    block_table: torch.Tensor,
    forward_metadata: TorchAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """torch_ref.mla_attention with the capacity decode."""
    return torch_ref.mla_attention(
        q_nope,
        q_pe,
        latent_cache,
        kv_b_weight,
        block_table,
        forward_metadata,
        scale,
        decode_attention=paged_decode_attention,
    )
