"""Torch reference for DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): the lightning indexer's
scores and top-k over a paged cache of indexer keys, and MLA over the selected tokens only.

The indexer keeps one key of index_head_dim per token in a cache of its own (beside MLA's latent).
Each query scores every cached token of its request, sum_h w_h * relu(q_h . k * softmax_scale), masks
the tokens after it, and keeps the index_topk best with torch.topk over its request's whole row, as
transformers' DeepseekV32Indexer does, so that ties break as there. The attention then gathers only
those tokens' latents: its cost per query is fixed by top-k, whatever the context. An int8 indexer
key cache (dynamic C8) holds one scale per token, dequantized as it is gathered.
"""

from __future__ import annotations

import torch

from ops import quant_math
from ops.attention.metadata import TorchAttentionMetadata
from ops.attention.reference import split_kv_b

NOT_SELECTED = -1  # a top-k slot that holds no token: past a short row's length, or after the query


def gather_index_keys(
    index_cache: torch.Tensor, block_ids: torch.Tensor, length: int, index_scale: torch.Tensor | None
) -> torch.Tensor:
    """One request's first `length` indexer keys [length, D] in fp32 (an int8 cache times its
    per-token scales [num_blocks, block_size, 1])."""
    keys = index_cache[block_ids].flatten(0, 1)[:length]
    if index_cache.dtype != torch.int8:
        return keys.float()
    assert index_scale is not None, "an int8 indexer key cache needs its scales"
    return quant_math.dequantize_kv(keys, torch.float32, token_scale=index_scale[block_ids].flatten(0, 1)[:length, 0])


def request_topk(
    query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float, topk: int
) -> torch.Tensor:
    """One request's last q_len queries over its `keys` [L, D] -> [q_len, topk] token positions.

    query [q_len, H, D], weights [q_len, H] (fp32, weights_proj's output times H**-0.5). Scores as
    transformers' indexer computes them; tokens after a query are -inf before torch.topk over the
    row of all L tokens; picks among them, and the slots past L, are NOT_SELECTED."""
    q_len, length = query.shape[0], keys.shape[0]
    scores = torch.relu(torch.matmul(query.float(), keys.transpose(0, 1)) * softmax_scale)  # [q_len, H, L]
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [q_len, L]
    query_positions = torch.arange(length - q_len, length, device=query.device)[:, None]
    after = torch.arange(length, device=query.device)[None, :] > query_positions
    index_scores = index_scores.masked_fill(after, float("-inf"))
    picks = index_scores.topk(min(topk, length), dim=-1).indices
    picks = picks.masked_fill(picks > query_positions, NOT_SELECTED)
    return torch.nn.functional.pad(picks, (0, topk - picks.shape[1]), value=NOT_SELECTED)


@torch.library.custom_op("infer_recipes::indexer_topk", mutates_args=())
def indexer_topk_rows(
    query: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_ends: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    topk: int,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """indexer_topk over tensors: one opaque op for compilers (fixed output [T, topk]) whose body
    reads the lengths on the host and scores each request over its own tokens only."""
    block_size = index_cache.shape[1]
    outputs = []
    query_start = 0
    for index, (query_end, length) in enumerate(zip(query_ends.tolist(), seq_lens.tolist(), strict=True)):
        block_ids = block_table[index, : -(-length // block_size)].long()
        keys = gather_index_keys(index_cache, block_ids, length, index_scale)
        rows = slice(query_start, query_end)
        outputs.append(request_topk(query[rows], weights[rows], keys, softmax_scale, topk))
        query_start = query_end
    return torch.cat(outputs)


@indexer_topk_rows.register_fake
def _(query, weights, index_cache, block_table, query_ends, seq_lens, softmax_scale, topk, index_scale=None):
    return query.new_empty((query.shape[0], topk), dtype=torch.int64)


def indexer_topk(
    query: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    forward_metadata: TorchAttentionMetadata,
    softmax_scale: float,
    topk: int,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lightning indexer's selection: query [T, H, D] (rotated), weights [T, H] fp32, the paged
    indexer keys [num_blocks, block_size, D] of the layer's group -> [T, topk] int64 positions in
    each row's sequence (NOT_SELECTED where fewer tokens are visible). A decode step's rows are one
    query per request."""
    seq_lens = forward_metadata.seq_lens
    query_ends = forward_metadata.query_ends
    assert seq_lens is not None, "the torch metadata builder sets seq_lens every step"
    if forward_metadata.is_decode_shaped:
        query_ends = torch.arange(1, seq_lens.shape[0] + 1, device=seq_lens.device)
    return indexer_topk_rows(
        query, weights, index_cache, block_table, query_ends, seq_lens, softmax_scale, topk, index_scale
    )


def selected_slots(
    topk_indices: torch.Tensor, block_table: torch.Tensor, row_requests: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Positions [T, k] of each row's request -> cache slots [T, k]; NOT_SELECTED reads position 0's
    slot (always written), which the caller masks off."""
    positions = topk_indices.clamp(min=0)
    blocks = block_table[row_requests[:, None], positions // block_size].long()
    return blocks * block_size + positions % block_size


def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    forward_metadata: TorchAttentionMetadata,
    scale: float,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA over each query's selected tokens only -> [T, H, v], in latent space (W_UK folded into the
    query, W_UV into the output, as mla_decode_absorbed): the latents of the k positions in
    topk_indices [T, k] are gathered through the row's block table, so the work per query is
    H x k x (L + R) whatever the context. The selection already excludes the tokens after each
    query (causality); NOT_SELECTED slots are masked off. Prefill, chunks and decode alike."""
    num_rows = q_nope.shape[0]
    kv_lora_rank = latent_cache.shape[-1] - q_pe.shape[-1]
    if forward_metadata.is_decode_shaped:
        row_requests = torch.arange(num_rows, device=q_nope.device)
    else:
        rows = torch.arange(num_rows, device=q_nope.device)
        assert forward_metadata.query_ends is not None, "set for every step that is not decode-shaped"
        row_requests = torch.searchsorted(forward_metadata.query_ends, rows, right=True)
    slots = selected_slots(topk_indices, block_table, row_requests, latent_cache.shape[1])
    latents = latent_cache.view(-1, latent_cache.shape[-1])[slots]  # [T, k, L + R]
    if latent_cache.dtype == torch.int8:
        token_scale = None if latent_scale is None or latent_scale.dim() != 3 else latent_scale.view(-1)[slots]
        channel_scale = None if token_scale is not None else latent_scale
        latents = quant_math.dequantize_kv(latents, q_nope.dtype, token_scale, channel_scale)
    w_uk, w_uv = split_kv_b(kv_b_weight, q_nope.shape[1], q_nope.shape[2])
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
    query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, L + R]
    scores = torch.einsum("thd,tkd->thk", query, latents) * scale
    scores = scores.masked_fill((topk_indices < 0)[:, None, :], float("-inf"))
    out = torch.einsum("thk,tkl->thl", scores.softmax(dim=-1), latents[..., :kv_lora_rank])
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
