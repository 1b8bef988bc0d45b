"""Context parallel (parallel_config.cp_size): a prefill step's tokens split over the ranks along
the sequence, each rank running its share through every layer (docs/distributed.md). Decode and
verify steps run whole on every rank (splits_step), as cann-recipes splits prefill steps only.

The split (cann-recipes' head-tail zigzag): a request's tokens of the step are cut into 2 x cp
segments, as even as integer division makes them, and a rank takes one segment from the head and
its mirror from the tail (h and 2 cp - 1 - h), so that under the causal mask every rank attends over
about as many keys. h = (cp rank + request index) mod cp: the request's index turns the deal. Each
segment runs as a request of its own: its queries over the request's blocks, with the positions
before it as a cached prefix, which every rank holds since each layer all-gathers the step's K/V and
writes every token's before it attends (ops.attention.metadata.cache_writes). A rank whose share is empty
runs one padding row on the null block, so that it joins every collective.
"""

from __future__ import annotations

import torch

from executor.core.model_worker.bucket_padding import padding_step
from module.attention import KVCacheLayer
from module.parallel_group import ParallelGroup
from ops.attention.metadata import (
    AttentionMetadataBuilder,
    ContextParallelRows,
    ScheduledSequence,
    StepLayout,
    build_model_inputs,
    to_device,
)


def layers_without_context_parallel(model: torch.nn.Module) -> list[str]:
    """The classes of the model's cache layers that do not write through ops.attention.metadata.cache_writes
    and attend through their block table (KVCacheLayer.context_parallel): recurrent states and
    compressed KV. Under context parallel such a model is refused before its weights load."""
    layers = {type(m).__name__ for m in model.modules() if isinstance(m, KVCacheLayer) and not m.context_parallel}
    return sorted(layers)


def splits_step(sequences: list[ScheduledSequence]) -> bool:
    """Whether a step is split over the CP group: when some request computes a row it samples no
    token from (a prompt token, or one recomputed after a preemption), i.e. the step holds a
    prefill. Decode and verify rows all sample, so such steps run whole on every rank, which holds
    every token's K/V: in a graph where one serves them, with no CP collective. Every rank schedules
    the same sequences, so every rank takes the same decision."""
    return any(len(seq.token_ids) > seq.num_sampled_rows for seq in sequences)


def segment(num_tokens: int, index: int, num_segments: int) -> range:
    """The `index`-th of `num_segments` consecutive segments of range(num_tokens), as even as integer
    division makes them (the later ones are the longer)."""
    return range(index * num_tokens // num_segments, (index + 1) * num_tokens // num_segments)


def request_share(num_tokens: int, request_index: int, cp_size: int, cp_rank: int) -> tuple[range, range]:
    """The head and tail segments (offsets into the request's tokens of the step) that `cp_rank` computes."""
    head = (cp_rank + request_index) % cp_size
    return segment(num_tokens, head, 2 * cp_size), segment(num_tokens, 2 * cp_size - 1 - head, 2 * cp_size)


def rank_rows(query_ends: list[int], cp_size: int, cp_rank: int) -> list[tuple[int, range]]:
    """The step's rows `cp_rank` computes: (request index, rows) per non-empty segment, request by request."""
    shares = []
    for index, (start, end) in enumerate(zip([0, *query_ends[:-1]], query_ends, strict=True)):
        for part in request_share(end - start, index, cp_size, cp_rank):
            if part:
                shares.append((index, range(start + part.start, start + part.stop)))
    return shares


def local_layout(layout: StepLayout, shares: list[tuple[int, range]]) -> StepLayout:
    """`layout` cut to `shares` (rank_rows): each segment a request over its request's blocks, the
    positions before it its cached prefix; a layout of one padding row where there is none."""
    num_groups = len(layout.block_ids)
    if not shares:
        return padding_step(1, num_groups, layout.max_blocks_per_request, layout.state_groups)
    local = StepLayout(
        [],
        [],
        [],
        [],
        [[] for _ in range(num_groups)],
        [[] for _ in range(num_groups)],
        [],
        layout.max_blocks_per_request,
        state_groups=layout.state_groups,
    )
    for request, rows in shares:
        local.input_ids.extend(layout.input_ids[rows.start : rows.stop])
        local.positions.extend(layout.positions[rows.start : rows.stop])
        local.query_ends.append(len(local.input_ids))
        local.seq_lens.append(layout.positions[rows.stop - 1] + 1)
        for group, block_ids in enumerate(layout.block_ids):
            local.block_ids[group].append(block_ids[request])
            if group not in layout.state_groups:
                local.slot_mappings[group].extend(layout.slot_mappings[group][rows.start : rows.stop])
    return local


def gather_order(rows_per_rank: list[list[int]], num_rows: int) -> list[int]:
    """Where each of the step's `num_rows` rows lies once every rank's rows are gathered in rank order
    (a rank with none sends its one padding row, which no row points at)."""
    order = [-1] * num_rows
    offset = 0
    for rows in rows_per_rank:
        for index, row in enumerate(rows):
            order[row] = offset + index
        offset += max(len(rows), 1)
    assert -1 not in order, "every row of the step is some rank's"
    return order


class ContextParallelForward:
    """The model on a step split over the context-parallel group; the rows the step reads logits
    from are gathered back, so every rank samples the same tokens and schedules the same next step.
    `every_row`: gather every row's hidden state instead, for a proposer that reads them all (MTP
    writes its own K/V at every prompt position), so that it runs whole on every rank."""

    def __init__(
        self, group: ParallelGroup, metadata_builder: AttentionMetadataBuilder, *, every_row: bool = False
    ) -> None:
        assert group.size > 1
        self.group = group
        self.metadata_builder = metadata_builder
        self.every_row = every_row

    def __call__(self, model: torch.nn.Module, layout: StepLayout) -> torch.Tensor:
        """Hidden states [T, hidden] of the whole step, filled at the rows whose logits it takes (the
        sampled and prompt-logprob rows, gathered from the ranks that computed them), zero elsewhere;
        every row's with `every_row`."""
        size, rank = self.group.size, self.group.rank
        shares_per_rank = [rank_rows(layout.query_ends, size, r) for r in range(size)]
        rows_per_rank = [[row for _, rows in shares for row in rows] for shares in shares_per_rank]
        num_rows = len(layout.input_ids)
        device = self.metadata_builder.device
        inputs = build_model_inputs(local_layout(layout, shares_per_rank[rank]), self.metadata_builder)
        step_rows = ContextParallelRows(
            self.group,
            to_device(gather_order(rows_per_rank, num_rows), torch.int64, device),
            [
                None if group in layout.state_groups else to_device(slots, torch.int64, device)
                for group, slots in enumerate(layout.slot_mappings)
            ],
        )
        inputs.forward_metadata.context_parallel = step_rows
        hidden_states = model(*inputs.forward_args())
        if self.every_row:  # gathered as the layers gather K/V: every rank's rows, in the step's order
            return self.group.gather_rows(hidden_states)[0].index_select(0, step_rows.order)
        full = hidden_states.new_zeros((num_rows, hidden_states.shape[-1]))
        wanted = set(layout.logits_indices + layout.prompt_logprob_indices)
        if not wanted:  # the same on every rank: a prompt chunk short of its end takes no logits
            return full
        mine = [index for index, row in enumerate(rows_per_rank[rank]) if row in wanted]
        gathered, _ = self.group.gather_rows(hidden_states[to_device(mine, torch.int64, device)])
        owned = [row for rows in rows_per_rank for row in rows if row in wanted]  # the gathered rows' order
        full[to_device(owned, torch.int64, device)] = gathered
        return full
