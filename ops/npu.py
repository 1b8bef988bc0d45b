"""torch_npu implementations of the ops (Atlas A2/A3), as laid out in shared/npu-api-facts.md §3.

torch_npu is fetched from executor.platform.npu_runtime at call time, so this module imports on
any machine; ops.set_backend("npu") is where a missing torch_npu is reported.
"""

from __future__ import annotations

import functools

import torch

from executor.core.types_.forward_metadata import ForwardMetaData
from executor.platform.npu_runtime import torch_npu

# FIA's compressed causal mask for sparse_mode=3 (bottom-right causal): always 2048x2048, 1 = masked.
_CAUSAL_MASK_SIZE = 2048
# npu_apply_rotary_pos_emb handles q and k in one kernel but only for these head dims.
_FUSED_ROTARY_HEAD_DIMS = (64, 128)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_npu().npu_rms_norm(x, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, _, new_residual = torch_npu().npu_add_rms_norm(x, residual, weight, eps)
    return normed, new_residual


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """BSND with B=1: query [1, T, H, D], cos [1, T, 1, D]."""
    npu = torch_npu()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    query, key = query.contiguous().unsqueeze(0), key.contiguous().unsqueeze(0)
    if query.shape[-1] in _FUSED_ROTARY_HEAD_DIMS:
        npu.npu_apply_rotary_pos_emb(query, key, cos, sin)  # rotates query and key in place
    else:
        query, key = npu.npu_rotary_mul(query, cos, sin), npu.npu_rotary_mul(key, cos, sin)
    return query[0], key[0]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_swiglu(x, dim=-1)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    torch_npu().npu_scatter_pa_kv_cache(
        key.contiguous(), value.contiguous(), key_cache, value_cache, slot_mapping, cache_mode="Norm"
    )


@functools.cache
def _causal_mask(device: torch.device) -> torch.Tensor:
    mask = torch.triu(torch.ones(_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE, dtype=torch.bool), diagonal=1)
    return mask.to(torch.int8).to(device)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    forward_metadata: ForwardMetaData,
    scale: float,
) -> torch.Tensor:
    """One fused call for prefill (with or without a cached prefix) and decode, as vllm-ascend does.

    TND with paged KV takes cumulative query ends but per-request KV lengths, and the cache as
    [num_blocks, block_size, Hkv * D]. Prefill needs block_size to be a multiple of 128.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    mask = _causal_mask(query.device) if forward_metadata.is_prefill else None
    output, _ = torch_npu().npu_fused_infer_attention_score(
        query,
        key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        atten_mask=mask,
        block_table=forward_metadata.block_table,
        actual_seq_lengths=forward_metadata.actual_seq_lengths_q_list,
        actual_seq_lengths_kv=forward_metadata.actual_seq_lengths_kv_list,
        num_heads=query.shape[1],
        num_key_value_heads=num_kv_heads,
        scale=scale,
        input_layout="TND",
        sparse_mode=3 if forward_metadata.is_prefill else 0,
        block_size=block_size,
    )
    return output
