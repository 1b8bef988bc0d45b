"""The CUDA graph backend's own forms: what a captured graph must do differently from eager CUDA.

A captured graph may read nothing on the host (the capture would sync, and the replay would keep
the first step's value), and it is replayed for every later length; so its decode attention
gathers the block table's whole capacity instead of reading the step's longest length. The backend
record passes it to the reference's attention ops as their `decode_attention` (ops/backend.py).
"""

from __future__ import annotations

import torch

from ops import torch_ref


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch_ref.paged_decode_attention over the table's capacity (positions past each length are
    masked), an int8 cache dequantized as gathered."""
    capacity = block_table.shape[1] * key_cache.shape[1]
    return torch_ref.gathered_decode_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        scale,
        sliding_window,
        sinks,
        capacity,
        key_scale,
        value_scale,
    )
