"""Packing one step's requests into flat TND inputs as host lists (StepLayout).

Everything is built on the host as Python lists, with no loop per token (ranges per request and
per block), and copied to the device once per tensor
(ops.attention_metadata.build_model_inputs), so the hot loop makes no device round-trips; the ops
backend's builder decides which tensors exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.types_.model_inputs import StepLayout


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: the tokens it feeds and where its K/V lives."""

    token_ids: list[int]  # the tokens fed this step (a prompt or a chunk of it, the last token, ...)
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_ids: list[list[int]]  # per cache group: blocks holding positions 0 .. num_computed + len(token_ids) - 1
    # Rows at the end of this sequence whose logits the step samples: 1 normally, 0 for a prompt
    # chunk that does not reach the prompt's end, k + 1 for a verify step of k draft tokens.
    num_sampled_rows: int = 1


def build_step_layout(
    sequences: list[ScheduledSequence], *, block_size: int, max_blocks_per_request: int
) -> StepLayout:
    """Pack `sequences` into token ids, positions, per-group slot mappings and lengths."""
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
    )
    for seq in sequences:
        start = seq.num_computed_tokens
        end = start + len(seq.token_ids)
        layout.input_ids.extend(seq.token_ids)
        layout.positions.extend(range(start, end))
        for group, block_ids in enumerate(seq.block_ids):
            assert len(block_ids) * block_size >= end, "sequence has too few blocks for its tokens"
            layout.block_ids[group].append(block_ids)
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
