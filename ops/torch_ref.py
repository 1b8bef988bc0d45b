"""Torch reference for every op: the definition of what each op computes, and the CPU/CUDA path.

Numerics follow Hugging Face (RMSNorm in fp32 then cast back, weight applied after the cast) so
that fp32 parity tests hold to 1e-4; attention computes in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.core.types_.forward_metadata import ForwardMetaData


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


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One request's first kv_len cached tokens as [Hkv, kv_len, D]."""
    return cache[block_ids].flatten(0, 1)[:kv_len].transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    forward_metadata: ForwardMetaData,
    scale: float,
) -> torch.Tensor:
    """One batched SDPA for one query token per request, over K/V gathered up to the longest KV.

    The gather follows forward_metadata.decode_kv_slots, whose padding positions repeat a written
    slot of the same request: unwritten slots may hold anything (NaN included) and are never read,
    and the mask drops the repeats.
    """
    slots, mask = forward_metadata.decode_kv_slots, forward_metadata.decode_kv_mask
    batch_size, max_kv_len = slots.shape
    num_kv_heads, head_dim = key_cache.shape[2:]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, slots.flatten())
        return rows.view(batch_size, max_kv_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]

    out = F.scaled_dot_product_attention(
        query.reshape(batch_size, 1, *query.shape[1:]).transpose(1, 2),  # [B, H, 1, D]
        gather(key_cache),
        gather(value_cache),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(query.shape)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    forward_metadata: ForwardMetaData,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over each request's paged K/V -> [T, H, D].

    K/V are read only through forward_metadata.block_table and actual_seq_lengths_kv. A request
    whose query is shorter than its KV (cached prefix) is causal from the bottom-right corner:
    its query row j sees KV positions <= kv_len - q_len + j.

    A step with decode_kv_slots (one query token per request) runs as one batched call; otherwise one SDPA per
    request, which reads only the request's first kv_len slots, all of them written.
    """
    if forward_metadata.decode_kv_slots is not None:  # one query token per request
        return _decode_attention(query, key_cache, value_cache, forward_metadata, scale)
    block_size = key_cache.shape[1]
    outputs = []
    query_start = 0
    for index, (query_end, kv_len) in enumerate(
        zip(forward_metadata.actual_seq_lengths_q_list, forward_metadata.actual_seq_lengths_kv_list, strict=True)
    ):
        q_len = query_end - query_start
        block_ids = forward_metadata.block_table[index, : -(-kv_len // block_size)]
        request_query = query[query_start:query_end].transpose(0, 1)  # [H, q_len, D]
        key = _gather_kv(key_cache, block_ids, kv_len)
        value = _gather_kv(value_cache, block_ids, kv_len)
        if q_len == kv_len:
            mask, is_causal = None, True
        else:  # bottom-right causal: query row j is token kv_len - q_len + j
            rows = torch.arange(kv_len - q_len, kv_len, device=query.device)
            mask, is_causal = torch.arange(kv_len, device=query.device)[None, :] <= rows[:, None], False
        out = F.scaled_dot_product_attention(
            request_query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
        outputs.append(out.transpose(0, 1))
        query_start = query_end
    return torch.cat(outputs)
