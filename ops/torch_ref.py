"""Torch reference for every op: the definition of what each op computes, and the CPU/CUDA path.

Numerics follow Hugging Face (RMSNorm in fp32 then cast back, weight applied after the cast) so
that fp32 parity tests hold to 1e-4; attention computes in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.attention_metadata import TorchAttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the new residual comes out of the same pass."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, Hkv, D] by cos/sin [T, D] (HF rotate_half convention).

    Use the returned tensors; an implementation may rotate its inputs in place.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, with the gate in the first half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] in place, token i
    at slot_mapping[i] = block_id * block_size + offset."""
    # The caches viewed as [num_slots, Hkv, D]: slot ids index rows directly.
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, first: int, kv_len: int) -> torch.Tensor:
    """One request's cached tokens [first, kv_len) as [Hkv, kv_len - first, D]; `block_ids` is its
    row from block first // block_size on."""
    offset = first % cache.shape[1]
    return cache[block_ids].flatten(0, 1)[offset : offset + kv_len - first].transpose(0, 1)


def _gathered_length(seq_lens: torch.Tensor, table_capacity: int) -> int:
    """How many positions decode attention gathers: the step's longest sequence, which needs a host
    read of the lengths; inside a CUDA graph capture (no host reads, and the graph is replayed for
    every later length) the block table's whole capacity."""
    if seq_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return table_capacity
    return int(seq_lens.max())


@torch.library.custom_op("infer_recipes::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """One query token per request [B, H, D] over its paged K/V -> [B, H, D], in one batched SDPA.

    Registered as an op so that compilers see one opaque call with fixed shapes ([B, max_blocks]
    block table, [B] lengths) while the body reads the lengths and gathers only the real K/V, up to
    the longest sequence of the step, never the table's whole width. Positions past a request's
    length (and before its window, when `sliding_window` > 0) gather its last written slot instead
    and are masked off: unwritten slots may hold anything (NaN included) and are never read.
    """
    batch_size = query.shape[0]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    max_len = _gathered_length(seq_lens, block_table.shape[1] * block_size)
    positions = torch.arange(max_len, device=query.device)
    slots = block_table[:, positions // block_size].long() * block_size + positions % block_size
    mask = positions[None, :] < seq_lens[:, None]
    if sliding_window > 0:
        mask &= positions[None, :] >= (seq_lens - sliding_window)[:, None]
    last_written = slots.gather(1, (seq_lens - 1)[:, None])
    slots = torch.where(mask, slots, last_written).flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        return rows.view(batch_size, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]

    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [B, H, 1, D]
        gather(key_cache),
        gather(value_cache),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


@paged_decode_attention.register_fake
def _(query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window):
    return torch.empty_like(query)


def _prefill_mask(
    q_len: int, kv_len: int, first: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Bottom-right causal (query row j is token kv_len - q_len + j) over keys [first, kv_len),
    within the window if any; None where plain top-left causal is the same thing."""
    if q_len == kv_len and sliding_window is None:
        return None
    query_positions = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key_positions = torch.arange(first, kv_len, device=device)[None, :]
    mask = key_positions <= query_positions
    if sliding_window is not None:
        mask &= key_positions > query_positions - sliding_window
    return mask


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    forward_metadata: TorchAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over each request's paged K/V -> [T, H, D].

    K/V are read only through `block_table` (the layer's cache group) and the sequence lengths. A
    request whose query is shorter than its KV (cached prefix, chunk, verify step) is causal from
    the bottom-right corner. With `sliding_window` W a query token sees itself and the W - 1
    tokens before it, as transformers' sliding-window layers do.

    A decode-shaped step runs as one batched op; any other as one SDPA per request, which reads
    only the request's slots a query can see (the window's, with a window), all of them written.
    """
    if forward_metadata.is_decode_shaped:
        return paged_decode_attention(
            query, key_cache, value_cache, block_table, forward_metadata.seq_lens, scale, sliding_window or 0
        )
    block_size = key_cache.shape[1]
    outputs = []
    query_start = 0
    for index, (query_end, kv_len) in enumerate(
        zip(forward_metadata.query_ends_list, forward_metadata.seq_lens_list, strict=True)
    ):
        q_len = query_end - query_start
        # With a window, the first query sees nothing before kv_len - q_len - window + 1: those
        # blocks may be gone (the null block in the row), so they are not read at all.
        first = max(0, kv_len - q_len - sliding_window + 1) if sliding_window else 0
        block_ids = block_table[index, first // block_size : -(-kv_len // block_size)]
        request_query = query[query_start:query_end].transpose(0, 1)  # [H, q_len, D]
        key = _gather_kv(key_cache, block_ids, first, kv_len)
        value = _gather_kv(value_cache, block_ids, first, kv_len)
        mask = _prefill_mask(q_len, kv_len, first, sliding_window, query.device)
        out = F.scaled_dot_product_attention(
            request_query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        outputs.append(out.transpose(0, 1))
        query_start = query_end
    return torch.cat(outputs)
