"""DeepSeek-V4's KV compressors and its lightning indexer, over the paged cache (ops/compressed_kv.py
says where entries live).

A compressor projects every token to a value kv and a gate (wkv, wgate) and pools each closed window
of `ratio` tokens into one entry: softmax over the window of (gate + ape[offset]), per channel, the
weighted sum of kv, RMS-normed, then rotated at the window's first position. Heavily compressed
attention pools one window (non-overlapping); compressed sparse attention (`overlap`) projects two
series, Ca = [:head_dim] and Cb = [head_dim:], and pools window w's Cb with window w - 1's Ca (2 *
ratio slots; window 0 has no Ca half). So every entry is a function of the last 2 * ratio tokens.

The compressor state transformers carries between calls (the tokens of a window not yet closed, the
previous window's Ca) is here the per-token projections kept in the cache (`<name>_kv`,
`<name>_gate`): a token that closes a window reads its window's projections back through the block
table, whichever step wrote them. So a prompt chunked anywhere, a prefix-cache hit or a preempted
request's recompute pool the same entries.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from executor.types_.kv_cache_spec import KVTensorSpec, TPSplit
from module.interleaved_rope import InterleavedRope, apply_interleaved_rope
from module.linear import ColumnParallelLinear
from module.norm import RMSNorm
from ops.attention.metadata import ForwardMetaData
from ops.backend import Backend
from ops.compressed_kv import entry_slots, slots_of, write_cache_rows


class Compressor(nn.Module):
    """Entries of head_dim per `ratio` tokens; `name` prefixes its cache tensors."""

    def __init__(
        self,
        name: str,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        overlap: bool,
        norm_eps: float,
        *,
        backend: Backend,
    ) -> None:
        super().__init__()
        self.name = name
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = overlap
        self.width = 2 * head_dim if overlap else head_dim
        method = backend.linear_method()
        self.wkv = ColumnParallelLinear(hidden_size, self.width, bias=False, linear_method=method)
        self.wgate = ColumnParallelLinear(hidden_size, self.width, bias=False, linear_method=method)
        self.ape = nn.Parameter(torch.empty(ratio, self.width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, norm_eps, backend=backend)

    def spec_tensors(self, dtype: torch.dtype) -> list[KVTensorSpec]:
        """Whole on every attention TP rank: the compressor's projections are not split (SINGLE)."""
        whole = TPSplit.WHOLE
        return [
            KVTensorSpec(f"{self.name}_kv", (self.width,), dtype, tp_split=whole),
            KVTensorSpec(f"{self.name}_gate", (self.width,), dtype, tp_split=whole),
            KVTensorSpec(f"{self.name}_entries", (self.head_dim,), dtype, tokens_per_entry=self.ratio, tp_split=whole),
        ]

    def forward(
        self,
        hidden_states: torch.Tensor,
        caches: dict[str, torch.Tensor],
        block_table: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: InterleavedRope,
    ) -> torch.Tensor:
        """Write the step's projections, then the entry of every window a token of the step closes
        (the other tokens' rows go to the null block's first entry, which nothing reads: fixed
        shapes for a graph); -> the entries cache."""
        kv_cache, gate_cache = caches[f"{self.name}_kv"], caches[f"{self.name}_gate"]
        entry_cache = caches[f"{self.name}_entries"]
        write_cache_rows(self.wkv(hidden_states), kv_cache, slot_mapping)
        write_cache_rows(self.wgate(hidden_states), gate_cache, slot_mapping)
        ratio, block_size = self.ratio, kv_cache.shape[1]
        start = positions + 1 - ratio  # the first token of the window each token would close
        window = start[:, None] + torch.arange(-ratio if self.overlap else 0, ratio, device=positions.device)
        valid = window >= 0
        slots = slots_of(block_table, rows[:, None], window.clamp(min=0), block_size)
        kv, gate = kv_cache.view(-1, self.width)[slots], gate_cache.view(-1, self.width)[slots]
        ape = self.ape.repeat(2, 1) if self.overlap else self.ape
        gate = gate + ape
        if self.overlap:  # Ca of the previous window, then Cb of this one
            dim = self.head_dim
            kv = torch.cat((kv[:, :ratio, :dim], kv[:, ratio:, dim:]), dim=1)
            gate = torch.cat((gate[:, :ratio, :dim], gate[:, ratio:, dim:]), dim=1)
        kv = torch.where(valid[..., None], kv, kv.new_zeros(()))
        gate = gate.masked_fill(~valid[..., None], float("-inf"))
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        cos, sin = rope(start.clamp(min=0), "compress", pooled.dtype)
        entries = apply_interleaved_rope(self.norm(pooled), cos, sin)
        closes = ((positions + 1) % ratio == 0) & (start >= 0)
        window_index = torch.div(start.clamp(min=0), ratio, rounding_mode="floor")
        targets = entry_slots(block_table, rows, window_index, ratio, block_size)
        write_cache_rows(entries, entry_cache, torch.where(closes, targets, torch.zeros_like(targets)))
        return entry_cache


class Indexer(nn.Module):
    """The lightning indexer of compressed sparse attention: its own overlapping compressor at
    index_head_dim, queries from the attention's q latent (wq_b), per-head weights (weights_proj);
    picks index_topk entries per query (ops compressed_indexer_topk)."""

    def __init__(self, config: PretrainedConfig, ratio: int, *, backend: Backend) -> None:
        super().__init__()
        self.ops = backend
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.ratio = ratio
        self.top_k = config.index_topk
        method = backend.linear_method()
        self.compressor = Compressor(
            "indexer", config.hidden_size, self.head_dim, ratio, True, config.rms_norm_eps, backend=backend
        )
        self.wq_b = ColumnParallelLinear(
            config.q_lora_rank, self.num_heads * self.head_dim, bias=False, linear_method=method
        )
        self.weights_proj = ColumnParallelLinear(config.hidden_size, self.num_heads, bias=False, linear_method=method)

    def forward(
        self,
        hidden_states: torch.Tensor,
        q_latent: torch.Tensor,
        caches: dict[str, torch.Tensor],
        block_table: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: InterleavedRope,
        forward_metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """-> [T, index_topk] the entries each token attends to (-1: none)."""
        entries = self.compressor(hidden_states, caches, block_table, rows, positions, slot_mapping, rope)
        query = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        query = apply_interleaved_rope(query, *rope(positions, "compress", query.dtype))
        head_weights = self.weights_proj(hidden_states).float() * self.num_heads**-0.5
        return self.ops.compressed_indexer_topk(
            query,
            head_weights,
            entries,
            block_table,
            forward_metadata,
            positions,
            self.ratio,
            self.top_k,
            self.head_dim**-0.5,
        )
