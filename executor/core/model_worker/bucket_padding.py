"""A step padded into a graph bucket's shape (executor/core/model_worker/graph_runner.py): a fixed
number of requests, each of a fixed number of tokens, every token an attention row of its own, so
that the bucket's captured graph replays on any step that fits it."""

from __future__ import annotations

from ops.attention.metadata import StepLayout


def padding_step(
    num_rows: int,
    num_groups: int,
    max_blocks_per_request: int,
    state_groups: tuple[int, ...] = (),
    tokens_per_row: int = 1,
) -> StepLayout:
    """A step of `num_rows` padding requests of `tokens_per_row` tokens: what graph buffers are
    allocated from."""
    empty = StepLayout(
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
    return pad_step(empty, num_rows, tokens_per_row)


def pad_step(layout: StepLayout, num_rows: int, tokens_per_row: int = 1) -> StepLayout:
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
    assert layout.tokens_per_row == 1, "a step is padded once"
    assert layout.max_query_len <= tokens_per_row, f"rows of {layout.max_query_len} tokens exceed {tokens_per_row}"
    extra = num_rows - layout.num_rows
    assert extra >= 0, f"cannot pad {layout.num_rows} rows down to {num_rows}"
    if tokens_per_row == 1:
        rows = layout
    else:
        rows = StepLayout([], [], [], [], [[] for _ in layout.block_ids], [[] for _ in layout.slot_mappings], [], 0)
        for index, (start, end) in enumerate(zip([0, *layout.query_ends][:-1], layout.query_ends, strict=True)):
            count, pad = end - start, tokens_per_row - (end - start)
            rows.input_ids += layout.input_ids[start:end] + [0] * pad
            rows.positions += layout.positions[start:end] + [0] * pad
            rows.seq_lens += [position + 1 for position in layout.positions[start:end]] + [1] * pad
            for group, blocks in enumerate(layout.block_ids):
                padding_blocks = [] if group in layout.state_groups else blocks[index]
                rows.block_ids[group] += [blocks[index]] * count + [padding_blocks] * pad
                if group not in layout.state_groups:
                    rows.slot_mappings[group] += layout.slot_mappings[group][start:end] + [0] * pad
        rows.query_ends = list(range(1, len(rows.input_ids) + 1))
    padded_tokens = extra * tokens_per_row
    last_end = rows.query_ends[-1] if rows.query_ends else 0
    row_of = padded_token_rows(layout, tokens_per_row)
    return StepLayout(
        input_ids=rows.input_ids + [0] * padded_tokens,
        positions=rows.positions + [0] * padded_tokens,
        query_ends=rows.query_ends + list(range(last_end + 1, last_end + padded_tokens + 1)),
        seq_lens=rows.seq_lens + [1] * padded_tokens,
        block_ids=[group + [[]] * padded_tokens for group in rows.block_ids],
        slot_mappings=[
            slots if group in layout.state_groups else slots + [0] * padded_tokens
            for group, slots in enumerate(rows.slot_mappings)
        ],
        logits_indices=[row_of[row] for row in layout.logits_indices],
        max_blocks_per_request=layout.max_blocks_per_request,
        prompt_logprob_indices=[row_of[row] for row in layout.prompt_logprob_indices],
        state_groups=layout.state_groups,
        tokens_per_row=tokens_per_row,
    )


def padded_token_rows(layout: StepLayout, tokens_per_row: int) -> list[int]:
    """The row of each of this step's tokens in pad_step(_, _, tokens_per_row): request i's tokens
    start at row i * tokens_per_row."""
    if tokens_per_row == 1:
        return list(range(len(layout.input_ids)))
    starts = [0, *layout.query_ends][:-1]
    return [
        index * tokens_per_row + offset
        for index, (start, end) in enumerate(zip(starts, layout.query_ends, strict=True))
        for offset in range(end - start)
    ]
