"""Attention metadata per ops backend: what each backend's attention reads, built from a StepLayout.

The engine packs a step into host lists once (StepLayout); the backend's builder turns them into
exactly the tensors and lists its attention reads, nothing more. Block tables have a fixed width
(cdiv(max_model_len, block_size)), so a decode step's shapes depend only on its number of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from executor.types_.model_inputs import (
    CacheGroupTables,
    ForwardMetaData,
    ModelInputs,
    RecurrentStateTables,
    StepLayout,
)
from ops.attention import PagedKVLayer

# FIA's compressed causal mask for sparse_mode=3 (bottom-right causal): always 2048x2048, 1 = masked.
NPU_CAUSAL_MASK_SIZE = 2048


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device`. For CUDA the host tensor is pinned (torch's caching host allocator
    reuses those blocks step after step), so the copy is truly asynchronous and no sync waits on it."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def consecutive(rows: list[int]) -> slice | None:
    """`rows` as a slice where they run consecutively (a verify step whose every request feeds 1 + k
    tokens, a step that samples each of its rows), else None."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return None


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows]: a view where the rows are consecutive, else a gathered copy (at 32 rows of a
    50k-token vocabulary the copy alone took a millisecond on CPU)."""
    run = consecutive(rows)
    return tensor[run] if run is not None else tensor[to_device(rows, torch.int64, tensor.device)]


def put_rows(tensor: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """tensor[rows] = values, through a view where the rows are consecutive."""
    run = consecutive(rows)
    if run is not None:
        tensor[run].copy_(values, non_blocking=True)
    else:
        tensor.index_copy_(0, to_device(rows, torch.int64, tensor.device), values)


def block_table_tensor(block_ids: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] int32: each request's blocks, then the null block (0) to the fixed width."""
    counts = [len(ids) for ids in block_ids]
    assert max(counts, default=0) <= width, f"a request holds {max(counts)} blocks, more than the table's {width}"
    device = torch.device(device)
    table = torch.zeros(len(block_ids), width, dtype=torch.int32, pin_memory=device.type == "cuda")
    flat = [block for ids in block_ids for block in ids]
    if flat:
        counts_tensor = torch.tensor(counts)
        rows = torch.repeat_interleave(torch.arange(len(counts)), counts_tensor)
        row_starts = torch.repeat_interleave(counts_tensor.cumsum(0) - counts_tensor, counts_tensor)
        table[rows, torch.arange(len(flat)) - row_starts] = torch.tensor(flat, dtype=torch.int32)
    return table if device.type == "cpu" else table.to(device, non_blocking=True)


class AttentionMetadataBuilder:
    """Base: the per-group block tables and slot mappings (a recurrent group's state slots), which
    every backend reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, layout: StepLayout) -> ForwardMetaData:
        raise NotImplementedError

    def cache_group_tables(self, layout: StepLayout) -> list[CacheGroupTables | RecurrentStateTables]:
        return [
            self.state_tables(layout, block_ids)
            if group in layout.state_groups
            else CacheGroupTables(
                block_table=block_table_tensor(block_ids, layout.max_blocks_per_request, self.device),
                slot_mapping=to_device(slots, torch.int64, self.device),
            )
            for group, (block_ids, slots) in enumerate(zip(layout.block_ids, layout.slot_mappings, strict=True))
        ]

    def state_tables(self, layout: StepLayout, slots: list[list[int]]) -> RecurrentStateTables:
        """Each row's slots in its request's ring (RecurrentStateTables; the null slot 0 for a padded
        row): the one it reads, the one its final state goes to, and in a multi-token step those of
        each position where the row fits its ring; whether it continues a state; the query ends as a
        host list where a row may hold several tokens. A step padded into token rows (pad_to with
        tokens_per_row) reads per request and writes per token."""
        starts = [0, *layout.query_ends[:-1]]
        read, final, positions = [], [], []
        for ring, seq_len, start, end in zip(slots, layout.seq_lens, starts, layout.query_ends, strict=True):
            ring = ring or [0]
            computed = seq_len - (end - start)  # the row's first position
            read.append(ring[(computed - 1) % len(ring)])
            final.append(ring[(seq_len - 1) % len(ring)])
            fits = end - start <= len(ring)
            positions.append([ring[p % len(ring)] for p in range(computed, seq_len)] if fits else None)
        multi_token = layout.max_query_len > 1
        # rows of one token each, tokens_per_row per request: a request reads where its first token does
        per_request = slice(None, None, layout.tokens_per_row)
        return RecurrentStateTables(
            state_slots=to_device(read[per_request], torch.int64, self.device),
            has_initial_state=to_device(layout.has_initial_state[per_request], torch.bool, self.device),
            query_ends_list=list(layout.query_ends) if multi_token else None,
            final_state_slots=to_device(final, torch.int64, self.device),
            position_state_slots=positions if multi_token else None,
            tokens_per_row=layout.tokens_per_row,
        )


@dataclass(slots=True)
class TorchAttentionMetadata(ForwardMetaData):
    """The torch reference: decode reads the lengths as a tensor (inside one opaque op); other steps
    read them as tensors too in the CPU prefill kernel, and as host lists in the per-request loop."""

    seq_lens: torch.Tensor | None = None  # [rows] int64 KV lengths
    query_ends: torch.Tensor | None = None  # [rows] int64 cumulative query ends; other steps only
    query_ends_list: list[int] | None = None  # other steps only
    seq_lens_list: list[int] | None = None  # other steps only
    # decode-shaped steps, [1] int64: how many consecutive rows are one request's and share its block
    # table (a verify step's 1 + k tokens in a graph, StepLayout.pad_to; 1 otherwise). A tensor, so
    # that a verify bucket runs the graph of the decode bucket of its token count.
    rows_per_request: torch.Tensor | None = None


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, layout: StepLayout) -> TorchAttentionMetadata:
        metadata = TorchAttentionMetadata(layout.max_query_len, self.cache_group_tables(layout))
        metadata.seq_lens = to_device(layout.seq_lens, torch.int64, self.device)
        if metadata.is_decode_shaped:
            metadata.rows_per_request = to_device([layout.tokens_per_row], torch.int64, self.device)
        else:
            metadata.query_ends = to_device(layout.query_ends, torch.int64, self.device)
            metadata.query_ends_list = list(layout.query_ends)
            metadata.seq_lens_list = list(layout.seq_lens)
        return metadata


@dataclass(slots=True)
class NpuAttentionMetadata(ForwardMetaData):
    """npu_fused_infer_attention_score in TND with a paged cache: cumulative query ends and
    per-request KV lengths (host lists in eager mode, int64 device tensors for the torchair graph
    variant), and the mask and sparse mode the step's longest query calls for."""

    actual_seq_lengths_q: list[int] | torch.Tensor | None = None
    actual_seq_lengths_kv: list[int] | torch.Tensor | None = None
    atten_mask: torch.Tensor | None = None
    sparse_mode: int = 0


class NpuMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, device: torch.device, lengths_as_tensors: bool) -> None:
        super().__init__(device)
        self.lengths_as_tensors = lengths_as_tensors
        self._causal_mask: torch.Tensor | None = None

    def build(self, layout: StepLayout) -> NpuAttentionMetadata:
        metadata = NpuAttentionMetadata(layout.max_query_len, self.cache_group_tables(layout))
        if self.lengths_as_tensors:
            metadata.actual_seq_lengths_q = to_device(layout.query_ends, torch.int64, self.device)
            metadata.actual_seq_lengths_kv = to_device(layout.seq_lens, torch.int64, self.device)
        else:
            metadata.actual_seq_lengths_q = list(layout.query_ends)
            metadata.actual_seq_lengths_kv = list(layout.seq_lens)
        if not metadata.is_decode_shaped:  # a verify step (k+1 queries) is as causal as a prefill
            metadata.atten_mask = self.causal_mask()
            metadata.sparse_mode = 3  # bottom-right causal: queries aligned to the end of their KV
        return metadata

    def causal_mask(self) -> torch.Tensor:
        if self._causal_mask is None:
            size = NPU_CAUSAL_MASK_SIZE
            mask = torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1)
            self._causal_mask = mask.to(torch.int8).to(self.device)
        return self._causal_mask


class PagedAttention:
    """Per layer and step, what every attention backend over these metadata does, whatever its kernels
    (ops/attention/reference.py's ReferenceAttention and its subclasses for the CPU and CUDA graphs):
    write the step's K/V to the layer's caches, then attend through its cache group's block table, a
    decode-shaped step by the backend's `decode` and any other by its `prefill`."""

    # the backend's forms (ReferenceAttention's: their parameters are documented there)
    decode: Callable[[PagedKVLayer, torch.Tensor, torch.Tensor, TorchAttentionMetadata], torch.Tensor]
    prefill: Callable[
        [PagedKVLayer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TorchAttentionMetadata], torch.Tensor
    ]
    write_kv_cache: Callable[..., None]

    def write(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, metadata: ForwardMetaData) -> None:
        """The step's key/value [t, Hkv, D] into the layer's caches (under context parallel, every rank's)."""
        (key_rows, value_rows), slots = cache_writes(metadata, layer.kv_cache_group_id, key, value)
        self.write_kv_cache(key_rows, value_rows, layer.key_cache, layer.value_cache, slots, *layer.kv_scales())

    def forward(
        self,
        layer: PagedKVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """query [T, H, D] over the layer's cache, this step's K/V [T, Hkv, D] already written -> [T, H, D].
        It takes the step's K/V too, so that a prefill need not read them back from the cache."""
        assert isinstance(metadata, TorchAttentionMetadata)
        table = group_block_table(metadata, layer.kv_cache_group_id)
        if metadata.is_decode_shaped:
            return self.decode(layer, query, table, metadata)
        return self.prefill(layer, query, key, value, table, metadata)


def group_block_table(metadata: ForwardMetaData, group_id: int) -> torch.Tensor:
    """Cache group `group_id`'s block table for the step's rows."""
    tables = metadata.groups[group_id]
    assert isinstance(tables, CacheGroupTables), "a recurrent group has no block table"
    return tables.block_table


def cache_writes(
    metadata: ForwardMetaData, group_id: int, *rows: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What a layer writes to cache group `group_id` from its `rows` (K, V, a latent, ... [t, ...]):
    those rows and their slots; under context parallel every rank's rows (gathered from the ranks, in
    the step's token order) and the step's slots."""
    tables = metadata.groups[group_id]
    assert isinstance(tables, CacheGroupTables), "a recurrent group has no slots"
    cp = metadata.context_parallel
    if cp is None:
        return list(rows), tables.slot_mapping
    slots = cp.slot_mappings[group_id]
    assert slots is not None
    return [cp.group.gather_rows(row)[0].index_select(0, cp.order) for row in rows], slots


def build_model_inputs(layout: StepLayout, builder: AttentionMetadataBuilder) -> ModelInputs:
    device = builder.device
    return ModelInputs(
        input_ids=to_device(layout.input_ids, torch.int64, device),
        positions=to_device(layout.positions, torch.int64, device),
        forward_metadata=builder.build(layout),
        logits_indices=to_device(layout.logits_indices, torch.int64, device),
    )
