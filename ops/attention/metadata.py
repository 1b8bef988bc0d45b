"""A step's shape, from the scheduled sequences to what each attention backend reads.

Each request's share of a step (ScheduledSequence) is packed into host lists once, with no loop per
token (StepLayout: ranges per request and per block, build_step_layout); a backend's metadata builder
turns them into exactly the tensors and lists its attention reads (ForwardMetaData and a subclass per
backend: the torch backends' here, the NPU's in npu.py), copied once per tensor, so the hot loop makes
no device round-trips. Block tables have a fixed width (cdiv(max_model_len, block_size)), so in a
decode-shaped step every shape depends only on the number of rows and a padded graph bucket keeps one
shape for life (the padding: executor/core/model_worker/bucket_padding.py). A verify step (1 + k tokens
per request) enters a graph decode-shaped too, each token an attention row of its own.

The metadata is built once per step and passed down explicitly; no layer keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ops.attention import PagedKVLayer


@dataclass(slots=True)
class CacheGroupTables:
    """Where one cache group's K/V live for the step's rows."""

    # [rows, max_blocks_per_request] int32 physical block ids; fixed width, 0 (the null block) past the real ones.
    block_table: torch.Tensor
    # [T] int64 slot (block_id * block_size + offset) each new token's K/V is written to.
    slot_mapping: torch.Tensor


@dataclass(slots=True)
class RecurrentStateTables:
    """Where one recurrent group's states live for the step's rows (linear attention): each row reads
    its state from a slot (unless it starts fresh) and writes the state after its last token to a slot.

    A request holds S slots (1, or 1 + k with k draft tokens per verify step) used as a ring: the
    state after position p lives in the request's slot p mod S. A row whose tokens fit its ring (a
    decode or verify step) keeps the state after each of its positions, so that a verify step's
    accepted prefix leaves its state where the next step reads it; a longer row (a prompt chunk)
    keeps the state after its last token only. With one slot, every row reads and writes that slot.
    """

    state_slots: torch.Tensor  # [rows] int64 slot each row reads its state from; 0 (the null slot) for padded rows
    # [rows] bool: the row continues a state (tokens were computed before this step); False for a
    # request's first chunk (or its recompute after a preemption) and for padded rows, which start from zeros
    has_initial_state: torch.Tensor
    # cumulative query ends [rows] as a host list, for the per-request loops of multi-token steps
    # (None in decode-shaped steps, whose shapes depend only on the number of rows)
    query_ends_list: list[int] | None = None
    # [rows] int64 slot the state after each row's last token goes to (its ring's next slot; the
    # same as state_slots with one slot per request); None: state_slots
    final_state_slots: torch.Tensor | None = None
    # multi-token steps, per row: the slot of the state after each of its positions where the row
    # fits its ring (a verify step), else None (only the final state is kept); None in decode steps
    position_state_slots: list[list[int] | None] | None = None
    # A decode-shaped step whose rows hold this many tokens each, packed row after row (a verify step
    # in a graph: bucket_padding.pad_step): state_slots and has_initial_state are per row, final_state_slots
    # per token (the state after each token, the null slot for padding tokens). 1 in a decode step.
    tokens_per_row: int = 1

    @property
    def write_slots(self) -> torch.Tensor:
        """[rows] the slot each row's final state goes to ([tokens]: each token's, with tokens_per_row)."""
        return self.state_slots if self.final_state_slots is None else self.final_state_slots


class RowGatherer(Protocol):
    def gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """Every rank's rows concatenated in rank order (module/parallel_group.py's ParallelGroup)."""
        ...


@dataclass(slots=True)
class ContextParallelRows:
    """Under context parallel, where a step's K/V go: each rank computes the K/V of its own share of
    the step's tokens, and every rank writes every token's to its cache (the all-gather form), so that
    its queries read any earlier position, and decode reads any request, from its own cache."""

    group: RowGatherer  # the context-parallel group
    order: torch.Tensor  # [T] int64: where each of the step's tokens lies among the gathered rows
    slot_mappings: list[torch.Tensor | None]  # per cache group: the step's slots, every token's


@dataclass(slots=True)
class ForwardMetaData:
    """The part every ops backend reads; backends subclass it with their own fields."""

    max_query_len: int  # longest query of the step: 1 in decode, k+1 in a verify step
    # indexed by the layers' cache group id; a recurrent group's entry is its RecurrentStateTables
    groups: list[CacheGroupTables | RecurrentStateTables]
    # context parallel: the rows are this rank's share of the step, and what every rank writes to its cache
    context_parallel: ContextParallelRows | None = None

    @property
    def is_decode_shaped(self) -> bool:
        """The one definition, used by every backend: each request has one query token."""
        return self.max_query_len == 1


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: the tokens it feeds and where its K/V lives."""

    token_ids: list[int]  # the tokens fed this step (a prompt or a chunk of it, the last token, ...)
    num_computed_tokens: int  # tokens already in the KV cache before this step
    # per cache group: blocks holding positions 0 .. num_computed + len(token_ids) - 1 (a recurrent
    # group: the request's state slots)
    block_ids: list[list[int]]
    # Rows at the end of this sequence whose logits the step samples: 1 normally, 0 for a prompt
    # chunk that does not reach the prompt's end, k + 1 for a verify step of k draft tokens.
    num_sampled_rows: int = 1
    # Rows (offsets into token_ids) whose logits score the next prompt token, for a request that
    # asks for prompt logprobs; empty for every other request, whose other rows get no logits.
    prompt_logprob_rows: range = range(0)


@dataclass(slots=True)
class StepLayout:
    """One step's packed inputs as host lists, before any backend turns them into tensors.

    Request i owns rows query_ends[i-1]:query_ends[i] (cumulative, as the NPU's TND attention wants
    them) and has seq_lens[i] tokens of K/V after this step. The groups in `state_groups` are
    recurrent: block_ids holds each request's state slots there, and they have no slot mapping.
    """

    input_ids: list[int]
    positions: list[int]
    query_ends: list[int]
    seq_lens: list[int]
    block_ids: list[list[list[int]]]  # [group][request] the request's blocks (ragged)
    slot_mappings: list[list[int]]  # [group][token]
    logits_indices: list[int]  # rows whose logits the step samples
    max_blocks_per_request: int  # the fixed width of every block table
    # rows whose logits score a prompt token (ScheduledSequence.prompt_logprob_rows), never sampled
    prompt_logprob_indices: list[int] = field(default_factory=list)
    state_groups: tuple[int, ...] = ()  # recurrent cache groups (state slots, no blocks)
    # >1: a step padded by bucket_padding.pad_step into rows of one token each, tokens_per_row of them per request
    tokens_per_row: int = 1

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def has_initial_state(self) -> list[bool]:
        """Per row: whether tokens were computed before this step (a recurrent state to continue)."""
        starts = [0, *self.query_ends[:-1]]
        return [
            seq_len > end - start for seq_len, start, end in zip(self.seq_lens, starts, self.query_ends, strict=True)
        ]

    @property
    def max_query_len(self) -> int:
        starts = [0, *self.query_ends[:-1]]
        return max((end - start for start, end in zip(starts, self.query_ends, strict=False)), default=0)


def build_step_layout(
    sequences: list[ScheduledSequence],
    *,
    block_size: int,
    max_blocks_per_request: int,
    state_groups: tuple[int, ...] = (),
) -> StepLayout:
    """Pack `sequences` into token ids, positions, per-group slot mappings and lengths; the groups in
    `state_groups` keep each request's state slots and no slot mapping."""
    assert sequences, "a step needs at least one sequence"
    num_groups = len(sequences[0].block_ids)
    layout = StepLayout(
        input_ids=[],
        positions=[],
        query_ends=[],
        seq_lens=[],
        block_ids=[[] for _ in range(num_groups)],
        slot_mappings=[[] for _ in range(num_groups)],
        logits_indices=[],
        max_blocks_per_request=max_blocks_per_request,
        state_groups=state_groups,
    )
    for seq in sequences:
        start = seq.num_computed_tokens
        end = start + len(seq.token_ids)
        first_row = len(layout.input_ids)
        layout.prompt_logprob_indices.extend(
            range(first_row + seq.prompt_logprob_rows.start, first_row + seq.prompt_logprob_rows.stop)
        )
        layout.input_ids.extend(seq.token_ids)
        layout.positions.extend(range(start, end))
        for group, block_ids in enumerate(seq.block_ids):
            layout.block_ids[group].append(block_ids)
            if group in state_groups:
                assert block_ids, "a request in a recurrent group holds a state slot"
                continue
            assert len(block_ids) * block_size >= end, "sequence has too few blocks for its tokens"
            layout.slot_mappings[group].extend(_slots(block_ids, start, end, block_size))
        layout.query_ends.append(len(layout.input_ids))
        layout.seq_lens.append(end)
        layout.logits_indices.extend(range(len(layout.input_ids) - seq.num_sampled_rows, len(layout.input_ids)))
    return layout


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end): one range per block touched, no loop per token."""
    slots: list[int] = []
    for index in range(start // block_size, -(-end // block_size)):
        base, block_start = block_ids[index] * block_size, index * block_size
        slots.extend(range(base + max(start - block_start, 0), base + min(end - block_start, block_size)))
    return slots


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    forward_metadata: ForwardMetaData
    logits_indices: torch.Tensor  # [rows sampled] int64

    def forward_args(self) -> tuple[torch.Tensor, torch.Tensor, ForwardMetaData]:
        """What the model's forward reads (logits_indices is the sampler's)."""
        return self.input_ids, self.positions, self.forward_metadata


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


# Tables of up to this many entries are padded as Python lists and made one tensor (10 us for one
# request, where the scatter below takes 100: a drafter pass builds one per draft); larger ones scatter.
SMALL_BLOCK_TABLE = 4096


def block_table_tensor(block_ids: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] int32: each request's blocks, then the null block (0) to the fixed width."""
    counts = [len(ids) for ids in block_ids]
    assert max(counts, default=0) <= width, f"a request holds {max(counts)} blocks, more than the table's {width}"
    device = torch.device(device)
    if len(block_ids) * width <= SMALL_BLOCK_TABLE and device.type == "cpu":
        padded = [ids + [0] * (width - len(ids)) for ids in block_ids]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(block_ids), width)
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
        host list where a row may hold several tokens. A step padded into token rows (bucket_padding.pad_step with
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
    # table (a verify step's 1 + k tokens in a graph, bucket_padding.pad_step; 1 otherwise). A tensor, so
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
    write_kv_cache: Callable[[PagedKVLayer, torch.Tensor, torch.Tensor, torch.Tensor], None]

    def write(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, metadata: ForwardMetaData) -> None:
        """The step's key/value [t, Hkv, D] into the layer's caches (under context parallel, every rank's)."""
        (key_rows, value_rows), slots = cache_writes(metadata, layer.kv_cache_group_id, key, value)
        self.write_kv_cache(layer, key_rows, value_rows, slots)

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
