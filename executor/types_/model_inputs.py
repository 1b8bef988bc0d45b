"""The inputs of one forward pass: each request's share (ScheduledSequence), packed into host lists
(StepLayout, with no loop per token: ranges per request and per block), and the device tensors
built from them (ModelInputs, copied once per tensor by ops.attention_metadata.build_model_inputs,
so the hot loop makes no device round-trips; the ops backend's builder decides which tensors exist).

ForwardMetaData is what attention reads: built once per step through the backend's builder (which
adds what that backend's attention reads) and passed down explicitly; no layer keeps it. In a
decode-shaped step every shape depends only on the number of rows, so a padded graph bucket keeps
one shape for life. A verify step (1 + k tokens per request) enters a graph decode-shaped too, each
token an attention row of its own (StepLayout.pad_to with tokens_per_row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


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
    # in a graph: StepLayout.pad_to): state_slots and has_initial_state are per row, final_state_slots
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
    # >1: a step padded by pad_to into rows of one token each, tokens_per_row of them per request
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

    @classmethod
    def padding(
        cls,
        num_rows: int,
        num_groups: int,
        max_blocks_per_request: int,
        state_groups: tuple[int, ...] = (),
        tokens_per_row: int = 1,
    ) -> StepLayout:
        """A step of `num_rows` padding requests of `tokens_per_row` tokens: what graph buffers are
        allocated from."""
        empty = cls(
            [],
            [],
            [],
            [],
            [[] for _ in range(num_groups)],
            [[] for _ in range(num_groups)],
            [],
            max_blocks_per_request,
            state_groups=state_groups,
        )
        return empty.pad_to(num_rows, tokens_per_row)

    def pad_to(self, num_rows: int, tokens_per_row: int = 1) -> StepLayout:
        """This step as a graph bucket takes it: `num_rows` requests of `tokens_per_row` tokens, each
        token an attention row of its own, decode-shaped.

        A request's token at position p attends as a decode row whose K/V length is p + 1 over its
        request's blocks; after the request's own tokens come padding tokens, then padding requests.
        A padding token is token 0 at position 0 with one token of K/V: it writes to the null block's
        slot 0 and reads position 0 through its request's block table row (a padding request's is all
        null), so that all of a request's rows share one table (the CPU kernel reads their K/V once);
        in a recurrent group it takes the null state slot, started fresh. Its logits are never taken.
        So a request's tokens read only its own K/V, and no real token reads a padding token's. In a
        recurrent group the request keeps its ring: its first token reads the request's state, each
        token's state goes to its position's slot (RecurrentStateTables.tokens_per_row). With one
        token per request this is the decode step padded with padding rows.
        """
        assert self.tokens_per_row == 1, "a step is padded once"
        assert self.max_query_len <= tokens_per_row, f"rows of {self.max_query_len} tokens exceed {tokens_per_row}"
        extra = num_rows - self.num_rows
        assert extra >= 0, f"cannot pad {self.num_rows} rows down to {num_rows}"
        if tokens_per_row == 1:
            rows = self
        else:
            rows = StepLayout([], [], [], [], [[] for _ in self.block_ids], [[] for _ in self.slot_mappings], [], 0)
            for index, (start, end) in enumerate(zip([0, *self.query_ends][:-1], self.query_ends, strict=True)):
                count, pad = end - start, tokens_per_row - (end - start)
                rows.input_ids += self.input_ids[start:end] + [0] * pad
                rows.positions += self.positions[start:end] + [0] * pad
                rows.seq_lens += [position + 1 for position in self.positions[start:end]] + [1] * pad
                for group, blocks in enumerate(self.block_ids):
                    padding_blocks = [] if group in self.state_groups else blocks[index]
                    rows.block_ids[group] += [blocks[index]] * count + [padding_blocks] * pad
                    if group not in self.state_groups:
                        rows.slot_mappings[group] += self.slot_mappings[group][start:end] + [0] * pad
            rows.query_ends = list(range(1, len(rows.input_ids) + 1))
        padded_tokens = extra * tokens_per_row
        last_end = rows.query_ends[-1] if rows.query_ends else 0
        row_of = self.token_rows(tokens_per_row)
        return StepLayout(
            input_ids=rows.input_ids + [0] * padded_tokens,
            positions=rows.positions + [0] * padded_tokens,
            query_ends=rows.query_ends + list(range(last_end + 1, last_end + padded_tokens + 1)),
            seq_lens=rows.seq_lens + [1] * padded_tokens,
            block_ids=[group + [[]] * padded_tokens for group in rows.block_ids],
            slot_mappings=[
                slots if group in self.state_groups else slots + [0] * padded_tokens
                for group, slots in enumerate(rows.slot_mappings)
            ],
            logits_indices=[row_of[row] for row in self.logits_indices],
            max_blocks_per_request=self.max_blocks_per_request,
            prompt_logprob_indices=[row_of[row] for row in self.prompt_logprob_indices],
            state_groups=self.state_groups,
            tokens_per_row=tokens_per_row,
        )

    def token_rows(self, tokens_per_row: int) -> list[int]:
        """The row of each of this step's tokens in pad_to(_, tokens_per_row): request i's tokens
        start at row i * tokens_per_row."""
        if tokens_per_row == 1:
            return list(range(len(self.input_ids)))
        starts = [0, *self.query_ends][:-1]
        return [
            index * tokens_per_row + offset
            for index, (start, end) in enumerate(zip(starts, self.query_ends, strict=True))
            for offset in range(end - start)
        ]


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
