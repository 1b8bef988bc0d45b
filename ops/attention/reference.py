"""The reference attention: the definition of what each cache kind's attention computes, and the
backend that runs it on any device in torch ops (eager CUDA's, and the CPU's where its kernels did not
build).

An attention backend (one file per device in ops/attention/, as vLLM v1's attention backends) is one
object with `write(layer, key, value, metadata)` and `forward(layer, query, key, value, metadata)`
for the paged K/V kind (a window, sinks and C8 scales included), and `mla(layer, q_nope, q_pe,
metadata)` for MLA's latent. The layer carries its scale, window, sinks, scales and caches
(ops/attention/__init__.py's PagedKVLayer and LatentLayer), so no call passes them by position.
A device replaces the parts that differ: the CPU its kernels (ops/attention/cpu.py), a CUDA graph
its decode over the table's capacity (ops/attention/cuda_graph.py), the NPU its FIA
(ops/attention/npu.py).

Pure definitions: no device, dtype, compiling or capture check. Attention computes in the input
dtype. An int8 cache (C8) comes with its scales, `key_scale` / `value_scale` (or `latent_scale`):
per slot and KV head, [num_blocks, block_size, Hkv] (dynamic), or per channel, [Hkv, D] (static; see
ops/quant_math.py). The writes quantize; attention dequantizes what it gathers, and reads every key
from the cache, the step's own too, so a token attends alike whether its keys came this step or from
a cached prefix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops import quant_math
from ops.attention import ATTENTION_KINDS, LatentLayer, PagedKVLayer
from ops.attention.metadata import ForwardMetaData, PagedAttention, TorchAttentionMetadata, group_block_table


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] in place, token i
    at slot_mapping[i] = block_id * block_size + offset (int8 caches: quantized, see the module docstring)."""
    _write_rows(key, key_cache, slot_mapping, key_scale)
    _write_rows(value, value_cache, slot_mapping, value_scale)


def _write_rows(
    rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """rows [T, H, D] into cache [num_blocks, block_size, H, D] at their slots: as they are, or as int8 by
    the static per-channel `scale`, or by per-token-head scales that are written into `scale` too."""
    if cache.dtype == torch.int8:
        assert scale is not None, "an int8 KV cache needs its scales"
        if scale.dim() == 3:  # dynamic
            rows, row_scales = quant_math.quantize_kv_per_token_head(rows)
            scale.view(-1, rows.shape[1]).index_copy_(0, slot_mapping, row_scales)
        else:
            rows = quant_math.quantize_kv_static(rows, scale)
    # The cache viewed as [num_slots, H, D]: slot ids index rows directly.
    cache.view(-1, *rows.shape[1:]).index_copy_(0, slot_mapping, rows)


def _dequantized(
    values: torch.Tensor, scale: torch.Tensor | None, row_scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Gathered cache rows [..., Hkv, D] as `dtype`: as they are from a float cache; from an int8 one
    times their gathered per-token-head scales `row_scales` (dynamic) or the channels' `scale` (static)."""
    if values.dtype != torch.int8:
        return values
    if scale is not None and scale.dim() == 3:
        return quant_math.dequantize_kv(values, dtype, token_scale=row_scales)
    return quant_math.dequantize_kv(values, dtype, channel_scale=scale)


def _gather_kv(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    first: int,
    end: int,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One request's cached tokens [first, end) as [Hkv, end - first, D] (in `dtype` from an int8
    cache); `block_ids` is its row from block first // block_size on."""
    offset = first % cache.shape[1]
    rows = cache[block_ids].flatten(0, 1)[offset : offset + end - first]
    row_scales = None
    if scale is not None and scale.dim() == 3:
        row_scales = scale[block_ids].flatten(0, 1)[offset : offset + end - first]
    return _dequantized(rows, scale, row_scales, dtype).transpose(0, 1)


DecodeAttention = Callable[..., torch.Tensor]  # paged_decode_attention's signature


@torch.library.custom_op("infer_recipes::paged_decode_attention", mutates_args=())
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
    """One query token per request [B, H, D] over its paged K/V -> [B, H, D], in one batched SDPA.

    Registered as an op so that compilers see one opaque call with fixed shapes ([B, max_blocks]
    block table, [B] lengths) while the body reads the lengths and gathers only the real K/V, up to
    the longest sequence of the step, never the table's whole width. Positions past a request's
    length (and before its window, when `sliding_window` > 0) gather its last written slot instead
    and are masked off: unwritten slots may hold anything (NaN included) and are never read.
    With `sinks` [H], each head's softmax denominator has one more term (see _append_sink). An int8
    cache is dequantized as gathered, by `key_scale` / `value_scale` (the module docstring).

    The CPU backend's C++ kernel computes the same without the gathered copy (ops/attention/cpu.py), and the
    CUDA graph backend gathers the table's whole capacity instead of reading the lengths (ops/attention/cuda_graph.py).
    """
    caches = (key_cache, value_cache, block_table, seq_lens)
    max_len = int(seq_lens.max())  # a host read of the lengths
    return gathered_decode_attention(
        query, *caches, scale, sliding_window, sinks, key_scale, value_scale, max_len=max_len
    )


def gathered_decode_attention(
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
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """paged_decode_attention in torch ops: every request's K/V gathered over its first `max_len`
    positions (the step's longest sequence, or any bound above it; None: the block table's whole
    capacity, which reads no length on the host: a CUDA graph's decode, ops/attention/cuda_graph.py)."""
    batch_size = query.shape[0]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    if max_len is None:
        max_len = block_table.shape[1] * block_size
    positions = torch.arange(max_len, device=query.device)
    slots = block_table[:, positions // block_size].long() * block_size + positions % block_size
    mask = positions[None, :] < seq_lens[:, None]
    if sliding_window > 0:
        mask &= positions[None, :] >= (seq_lens - sliding_window)[:, None]
    last_written = slots.gather(1, (seq_lens - 1)[:, None])
    slots = torch.where(mask, slots, last_written).flatten()

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        row_scales = None
        if scale is not None and scale.dim() == 3:
            row_scales = scale.view(-1, num_kv_heads).index_select(0, slots)
        rows = _dequantized(rows, scale, row_scales, query.dtype)
        return rows.view(batch_size, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]

    key, value, attn_mask = gather(key_cache, key_scale), gather(value_cache, value_scale), mask[:, None, None, :]
    if sinks is not None:
        key, value, attn_mask = _append_sink(key, value, attn_mask, sinks)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [B, H, 1, D]
        key,
        value,
        attn_mask=attn_mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


@paged_decode_attention.register_fake
def _(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    scale,
    sliding_window,
    sinks=None,
    key_scale=None,
    value_scale=None,
):
    return torch.empty_like(query)


def _append_sink(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss) as one extra key that SDPA can take: a zero key, whose score q.k is
    0, plus an additive mask entry equal to the head's sink logit, and a zero value. So exp(sink)
    joins every query's softmax denominator and adds nothing to the output.

    key/value [..., Hkv, S, D], mask bool [..., 1, q, S] (True: attend), sinks [H]
    -> key/value [..., Hkv, S + 1, D] and a float mask [..., H, q, S + 1].
    """
    zeros = key.new_zeros(*key.shape[:-2], 1, key.shape[-1])
    key, value = torch.cat((key, zeros), dim=-2), torch.cat((value, zeros), dim=-2)
    *lead, _, q_len, kv_len = mask.shape
    num_heads = sinks.shape[0]
    bias = torch.zeros(mask.shape, dtype=key.dtype, device=key.device).masked_fill(~mask, float("-inf"))
    sink_column = sinks.to(key.dtype).view(num_heads, 1, 1).expand(*lead, num_heads, q_len, 1)
    return key, value, torch.cat((bias.expand(*lead, num_heads, q_len, kv_len), sink_column), dim=-1)


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


def _sdpa_per_request(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options) -> torch.Tensor:
    """SDPA of one request's [H, L, D] tensors, run as a batch of one: the CPU's flash kernel takes
    4-D inputs only, and 3-D ones fall to the math path (a materialised mask, the full score matrix
    and a NaN-safe softmax), which made a prefill step several times slower here."""
    mask = options.pop("attn_mask", None)
    return F.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=None if mask is None else mask[None], **options
    )[0]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    forward_metadata: TorchAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over each request's paged K/V -> [T, H, D].

    key/value [T, Hkv, D] are the step's own K/V, already written to the caches: a non-decode
    step reads each request's last q_len positions from them and only the cached prefix before
    those through `block_table` (the layer's cache group) and the sequence lengths. A request whose
    query is shorter than its KV (cached prefix, chunk, verify step) is causal from the bottom-right
    corner. With `sliding_window` W a query token sees itself and the W - 1 tokens before it, as
    transformers' sliding-window layers do. With `sinks` [H] (gpt-oss), a learned logit per query
    head is added to every softmax denominator, softmax([scores, sink]) with the sink's column
    dropped, so a head can attend to nothing.

    A decode-shaped step runs as one batched op over the cache (paged_decode_attention), any other
    as one SDPA per request (per_request_prefill_attention). An int8 cache comes with `key_scale` /
    `value_scale` (the module docstring).
    """
    if forward_metadata.is_decode_shaped:
        assert forward_metadata.seq_lens is not None
        paged = (key_cache, value_cache, block_table, forward_metadata.seq_lens)
        return paged_decode_attention(query, *paged, scale, sliding_window or 0, sinks, key_scale, value_scale)
    query_ends, seq_lens = _host_lengths(forward_metadata)
    caches = (key_cache, value_cache, block_table)
    return per_request_prefill_attention(
        query, key, value, *caches, query_ends, seq_lens, scale, sliding_window, sinks, key_scale, value_scale
    )


def _host_lengths(metadata: TorchAttentionMetadata) -> tuple[list[int], list[int]]:
    """A non-decode step's query ends and KV lengths as host lists."""
    assert metadata.query_ends_list is not None and metadata.seq_lens_list is not None
    return metadata.query_ends_list, metadata.seq_lens_list


def per_request_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_ends: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention of a non-decode step in torch ops, one SDPA per request: the definition of
    the CPU prefill kernel and the other devices' path. Each request's keys are its cached prefix,
    gathered from the slots a query can see (the window's, with a window), then its step's own
    (from an int8 cache: all of them gathered, dequantized)."""
    block_size = key_cache.shape[1]
    quantized = key_cache.dtype == torch.int8
    outputs = []
    query_start = 0
    for index, (query_end, kv_len) in enumerate(zip(query_ends, seq_lens, strict=True)):
        q_len = query_end - query_start
        cached_len = kv_len - q_len
        gathered_len = kv_len if quantized else cached_len
        # With a window, the first query sees nothing before cached_len - window + 1: those blocks
        # may be gone (the null block in the row), so they are not read at all.
        first = max(0, cached_len - sliding_window + 1) if sliding_window else 0
        fresh = slice(query_end, query_end) if quantized else slice(query_start, query_end)
        request_key = key[fresh].transpose(0, 1)  # [Hkv, q_len (none from an int8 cache), D]
        request_value = value[fresh].transpose(0, 1)
        if first < gathered_len:
            block_ids = block_table[index, first // block_size : -(-gathered_len // block_size)]
            gathered_key = _gather_kv(key_cache, block_ids, first, gathered_len, key_scale, query.dtype)
            gathered_value = _gather_kv(value_cache, block_ids, first, gathered_len, value_scale, query.dtype)
            request_key = torch.cat((gathered_key, request_key), dim=1)
            request_value = torch.cat((gathered_value, request_value), dim=1)
        mask = _prefill_mask(q_len, kv_len, first, sliding_window, query.device)
        if sinks is not None:
            if mask is None:  # top-left causal, q_len == kv_len
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
            request_key, request_value, mask = _append_sink(request_key, request_value, mask[None], sinks)
        out = _sdpa_per_request(
            query[query_start:query_end].transpose(0, 1),  # [H, q_len, D]
            request_key,
            request_value,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1))
        query_start = query_end
    return torch.cat(outputs)


def write_latent_cache(
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    latent_scale: torch.Tensor | None = None,
) -> None:
    """Store latent [T, D] into latent_cache [num_blocks, block_size, D] in place, token i at
    slot_mapping[i]; an int8 cache quantizes it as one head, with `latent_scale` [num_blocks,
    block_size, 1] (dynamic) or [1, D] (static)."""
    _write_rows(latent.unsqueeze(1), latent_cache.unsqueeze(2), slot_mapping, latent_scale)


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (nope + v), L] as W_UK [H, nope, L] and W_UV [H, v, L] (views)."""
    per_head = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])
    return per_head.split([qk_nope_head_dim, per_head.shape[1] - qk_nope_head_dim], dim=1)


def mla_attention_naive(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    block_table: torch.Tensor,
    query_ends: list[int],
    seq_lens: list[int],
    scale: float,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA with K/V decompressed per request: each request's latents [S, L] go through kv_b_proj into
    per-head k_nope and v, the shared rope key is appended to every head's key, then causal SDPA
    (bottom-right, as paged_attention). Reads only the request's real tokens through its blocks.

    q_nope [T, H, nope], q_pe [T, H, R] (rotated), latent_cache [num_blocks, block_size, L + R]
    -> [T, H, v]. Cheaper than the absorbed form when many queries share the keys (prefill).
    """
    num_heads, qk_nope_head_dim = q_nope.shape[1:]
    kv_lora_rank = latent_cache.shape[-1] - q_pe.shape[-1]
    block_size = latent_cache.shape[1]
    query = torch.cat((q_nope, q_pe), dim=-1)
    outputs = []
    query_start = 0
    for index, (query_end, kv_len) in enumerate(zip(query_ends, seq_lens, strict=True)):
        block_ids = block_table[index, : -(-kv_len // block_size)]
        cached = _gather_kv(latent_cache.unsqueeze(2), block_ids, 0, kv_len, latent_scale, query.dtype)[0]
        latent, k_pe = cached.split([kv_lora_rank, q_pe.shape[-1]], dim=-1)
        k_nope, value = (
            F.linear(latent, kv_b_weight)
            .view(kv_len, num_heads, -1)
            .split([qk_nope_head_dim, kv_b_weight.shape[0] // num_heads - qk_nope_head_dim], dim=-1)
        )
        key = torch.cat((k_nope, k_pe[:, None].expand(-1, num_heads, -1)), dim=-1)
        q_len = query_end - query_start
        mask = _prefill_mask(q_len, kv_len, 0, None, query.device)
        out = _sdpa_per_request(
            query[query_start:query_end].transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
        outputs.append(out.transpose(0, 1))
        query_start = query_end
    return torch.cat(outputs)


def mla_decode_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    decode_attention: DecodeAttention = paged_decode_attention,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA decode in latent space: W_UK folded into the query (q_nope W_UK -> [B, H, L]) and W_UV into
    the output, so attention runs as one-KV-head attention over the cached latents themselves (keys:
    the whole latent [L + R], values: its first L) and K/V are never decompressed. One query token
    per request; same inputs and output as mla_attention_naive.

    Runs paged_decode_attention with the latent cache as both K and V (one head of L + R) and keeps
    the first L of its output: one code path for the paged gather and its masking, at the price of
    gathering the latents twice and R / (L + R) extra work in the value product.
    """
    kv_lora_rank = latent_cache.shape[-1] - q_pe.shape[-1]
    w_uk, w_uv = split_kv_b(kv_b_weight, q_nope.shape[1], q_nope.shape[2])
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, B, nope] @ [H, nope, L]
    cache = latent_cache.unsqueeze(2)  # [num_blocks, block_size, 1, L + R]
    query = torch.cat((q_latent, q_pe), dim=-1)
    out = decode_attention(query, cache, cache, block_table, seq_lens, scale, 0, None, latent_scale, latent_scale)
    return torch.bmm(out[..., :kv_lora_rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    block_table: torch.Tensor,
    forward_metadata: TorchAttentionMetadata,
    scale: float,
    latent_scale: torch.Tensor | None = None,
    decode_attention: DecodeAttention | None = None,
) -> torch.Tensor:
    """Causal multi-head latent attention over the paged latent cache -> [T, H, v] (an int8 cache
    with its `latent_scale`: see write_latent_cache).

    A decode-shaped step takes the absorbed form (per token, H x (L + R) work per cached token and
    no decompression) over `decode_attention` (the reference's where None); any other step
    decompresses K/V per request (mla_attention_naive), where the decompression is shared by the
    request's many queries.
    """
    if forward_metadata.is_decode_shaped:
        assert forward_metadata.seq_lens is not None
        return mla_decode_absorbed(
            q_nope,
            q_pe,
            latent_cache,
            kv_b_weight,
            block_table,
            forward_metadata.seq_lens,
            scale,
            decode_attention or paged_decode_attention,
            latent_scale,
        )
    query_ends, seq_lens = _host_lengths(forward_metadata)
    return mla_attention_naive(
        q_nope, q_pe, latent_cache, kv_b_weight, block_table, query_ends, seq_lens, scale, latent_scale
    )


class ReferenceAttention(PagedAttention):
    """The attention backend in torch ops: the definition every other device's backend matches.

    A device's backend replaces what differs: `decode_attention` (one query row per request over the
    paged cache, paged_decode_attention's signature; MLA's absorbed decode runs it too), `decode` and
    `prefill` (the forward of a decode-shaped step and of any other), or the cache writes. `kinds`
    names the cache kinds served: a model needing another is refused when it is built, naming it.
    `write` and `forward`, the same for every such backend, are PagedAttention's."""

    name = "reference"
    kinds: frozenset[str] = ATTENTION_KINDS

    def __init__(self, decode_attention: DecodeAttention = paged_decode_attention) -> None:
        self.decode_attention = decode_attention

    def decode(
        self, layer: PagedKVLayer, query: torch.Tensor, block_table: torch.Tensor, metadata: TorchAttentionMetadata
    ) -> torch.Tensor:
        assert metadata.seq_lens is not None
        caches = (layer.key_cache, layer.value_cache, block_table, metadata.seq_lens)
        window = layer.sliding_window or 0
        return self.decode_attention(query, *caches, layer.scale, window, layer.sinks, *layer.kv_scales())

    def prefill(
        self,
        layer: PagedKVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        block_table: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        caches = (layer.key_cache, layer.value_cache, block_table)
        query_ends, seq_lens = _host_lengths(metadata)
        key_scale, value_scale = layer.kv_scales()
        return per_request_prefill_attention(
            query,
            key,
            value,
            *caches,
            query_ends,
            seq_lens,
            layer.scale,
            layer.sliding_window,
            layer.sinks,
            key_scale,
            value_scale,
        )

    def write_kv_cache(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """The step's key/value [t, Hkv, D] into the layer's caches at `slots` (write_kv_cache)."""
        write_kv_cache(key, value, layer.key_cache, layer.value_cache, slots, *layer.kv_scales())

    def write_latent_cache(
        self,
        latent: torch.Tensor,
        latent_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        latent_scale: torch.Tensor | None = None,
    ) -> None:
        write_latent_cache(latent, latent_cache, slot_mapping, latent_scale)

    def mla(
        self, layer: LatentLayer, q_nope: torch.Tensor, q_pe: torch.Tensor, metadata: ForwardMetaData
    ) -> torch.Tensor:
        """MLA over the layer's latent cache (mla_attention), its decode by this backend's decode_attention."""
        assert isinstance(metadata, TorchAttentionMetadata)
        table = group_block_table(metadata, layer.kv_cache_group_id)
        args = (layer.latent_cache, layer.kv_b_weight, table, metadata, layer.scale, layer.latent_scale())
        return mla_attention(q_nope, q_pe, *args, self.decode_attention)
