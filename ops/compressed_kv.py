"""DeepSeek-V4's compressed-KV ops, in torch: the definitions, and what every backend runs (no NPU or
CUDA form of them is in shared/npu-api-facts.md, so those records hold these references too).

A V4 attention layer keeps, per token, its shared key-value `kv` (K = V, one head) and, in a
compressed layer, one compressed entry per `ratio` tokens (KVTensorSpec.tokens_per_entry): entry w
covers tokens [w * ratio, (w + 1) * ratio) and lives in the block of its first token, at entry
(w * ratio % block_size) // ratio of that block (block_size is a multiple of ratio). So the entry
slot of a window is the token slot of its first token // ratio, and a block table serves both.

Query t sees the keys of its sliding window (tokens t - window + 1 .. t) and the compressed entries
whose windows are closed by t, w < (t + 1) // ratio: all of them (heavily compressed attention),
or those the lightning indexer selected (compressed sparse attention). Both ops read the lengths
on the host, so they are opaque custom ops, as the reference's decode attention is: a compiled decode keeps
one graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from ops.attention.metadata import ForwardMetaData

if TYPE_CHECKING:
    from ops.attention.npu import NpuAttentionMetadata


def token_rows(forward_metadata: ForwardMetaData, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] the row (request) of each packed token: one each in a decode-shaped step, else by the
    cumulative query ends (torch metadata's query_ends, the NPU's actual_seq_lengths_q)."""
    if forward_metadata.is_decode_shaped:
        return torch.arange(num_tokens, device=device)
    ends = getattr(forward_metadata, "query_ends", None)
    if ends is None:
        ends = torch.as_tensor(cast("NpuAttentionMetadata", forward_metadata).actual_seq_lengths_q, device=device)
    lengths = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=num_tokens)


def request_seq_lens(forward_metadata: ForwardMetaData, device: torch.device) -> torch.Tensor:
    """[rows] each request's KV length after the step (the NPU's actual_seq_lengths_kv)."""
    seq_lens = getattr(forward_metadata, "seq_lens", None)
    if seq_lens is None:
        seq_lens = torch.as_tensor(cast("NpuAttentionMetadata", forward_metadata).actual_seq_lengths_kv, device=device)
    return seq_lens


def slots_of(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token slots of `positions` (any shape, >= 0) of requests `rows` (broadcast alike)."""
    blocks = block_table[rows, torch.div(positions, block_size, rounding_mode="floor")].long()
    return blocks * block_size + positions % block_size


def entry_slots(
    block_table: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int
) -> torch.Tensor:
    """Entry slots of compressed entries `entries` (>= 0) of requests `rows`: the slot of the
    window's first token // ratio (the module docstring)."""
    return torch.div(slots_of(block_table, rows, entries * ratio, block_size), ratio, rounding_mode="floor")


def write_cache_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, *shape] into cache [num_blocks, per_block, *shape] at `slots` (block * per_block + offset)."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))


def _gathered(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cache rows at `slots` [T, K] -> [T, K, D], zero where not `valid` (unwritten slots may hold NaN)."""
    rows = cache.view(-1, cache.shape[-1])[slots]
    return torch.where(valid[..., None], rows, rows.new_zeros(()))


def compressed_kv_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    entry_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    forward_metadata: ForwardMetaData,
    positions: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    sliding_window: int,
    ratio: int = 0,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, D] over each token's window of `kv_cache` [N, block_size, D] (written for this
    step already) and, with `entry_cache` [N, block_size // ratio, D], its closed compressed entries
    (or the `selected` ones [T, k], -1 for none) -> [T, H, D]. The keys are the values; softmax with
    a learned sink logit per head [H] in the denominator (gpt-oss's sinks), as transformers' V4."""
    rows = token_rows(forward_metadata, query.shape[0], query.device)
    return _compressed_kv_attention(
        query, kv_cache, entry_cache, block_table, rows, positions, sinks, scale, sliding_window, ratio, selected
    )


@torch.library.custom_op("infer_recipes::compressed_kv_attention", mutates_args=())
def _compressed_kv_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    entry_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    sliding_window: int,
    ratio: int,
    selected: torch.Tensor | None,
) -> torch.Tensor:
    block_size = kv_cache.shape[1]
    key_positions = positions[:, None] - sliding_window + 1 + torch.arange(sliding_window, device=query.device)
    valid = key_positions >= 0
    slots = slots_of(block_table, rows[:, None], key_positions.clamp(min=0), block_size)
    keys = _gathered(kv_cache, slots, valid)
    if entry_cache is not None:
        if selected is None:
            closed = torch.div(positions + 1, ratio, rounding_mode="floor")
            entries = torch.arange(int(closed.max()), device=query.device).expand(len(positions), -1)
            entry_valid = entries < closed[:, None]
        else:
            entries, entry_valid = selected, selected >= 0
        slots = entry_slots(block_table, rows[:, None], entries.clamp(min=0), ratio, block_size)
        keys = torch.cat((keys, _gathered(entry_cache, slots, entry_valid)), dim=1)
        valid = torch.cat((valid, entry_valid), dim=1)
    logits = torch.einsum("thd,tkd->thk", query, keys.to(query.dtype)) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_column = sinks.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    combined = torch.cat((logits, sink_column), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probabilities = F.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probabilities, keys.to(query.dtype))


@_compressed_kv_attention.register_fake
def _(query: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(query)


def compressed_indexer_topk(
    query: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    forward_metadata: ForwardMetaData,
    positions: torch.Tensor,
    ratio: int,
    top_k: int,
    softmax_scale: float,
) -> torch.Tensor:
    """The lightning indexer's choice: per query token [T, Hi, Di] with head weights [T, Hi], score
    every indexer entry (index_cache [N, block_size // ratio, Di]) as sum_h w_h relu(q_h . k) *
    softmax_scale, and keep the top_k of the entries closed by the token -> [T, top_k] entry ids,
    -1 past them.

    As transformers: torch.topk over a row as long as the entries the request holds after this
    step (seq_len // ratio, the later ones -inf), so that exact ties break as its forward over the
    same tokens breaks them (a prefill of the prompt, or one decode token)."""
    rows = token_rows(forward_metadata, query.shape[0], query.device)
    seq_lens = request_seq_lens(forward_metadata, query.device)
    caches = (index_cache, block_table, rows, seq_lens)
    return _compressed_indexer_topk(query, head_weights, *caches, positions, ratio, top_k, softmax_scale)


@torch.library.custom_op("infer_recipes::compressed_indexer_topk", mutates_args=())
def _compressed_indexer_topk(
    query: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    top_k: int,
    softmax_scale: float,
) -> torch.Tensor:
    selected = torch.full((query.shape[0], top_k), -1, dtype=torch.int64, device=query.device)
    row_lengths = torch.div(seq_lens[rows], ratio, rounding_mode="floor")  # entries after the step
    closed = torch.div(positions + 1, ratio, rounding_mode="floor")
    for length in row_lengths.unique().tolist():
        if length == 0:
            continue
        tokens = (row_lengths == length).nonzero().squeeze(1)
        entries = torch.arange(length, device=query.device).expand(len(tokens), -1)
        token_closed = closed[tokens, None]
        slots = entry_slots(block_table, rows[tokens, None], entries, ratio, index_cache.shape[1] * ratio)
        keys = _gathered(index_cache, slots, entries < token_closed)
        scores = F.relu(torch.einsum("thd,tkd->thk", query[tokens].float(), keys.float())) * softmax_scale
        scores = (scores * head_weights[tokens].float()[..., None]).sum(dim=1)
        scores = scores.masked_fill(entries >= token_closed, float("-inf"))
        picks = scores.topk(min(top_k, length), dim=-1).indices
        picks = torch.where(picks >= token_closed, torch.full_like(picks, -1), picks)
        selected[tokens, : picks.shape[1]] = picks
    return selected


@_compressed_indexer_topk.register_fake
def _(query: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, *args: object) -> torch.Tensor:
    top_k = cast(int, args[-2])  # the op's (..., ratio, top_k, softmax_scale)
    return query.new_empty((query.shape[0], top_k), dtype=torch.int64)
