"""Packing requests into TND inputs: slot mappings and fixed-width block tables per cache group,
cumulative and per-request lengths, sampled rows, padding to a graph bucket, and the torch
backend's metadata, whose decode shapes depend only on the number of rows."""

import dataclasses

import torch
from hypothesis import given
from hypothesis import strategies as st

from executor.core.model_worker.bucket_padding import pad_step
from executor.utils.tensor_tree import same_structure
from ops.attention.metadata import (
    SMALL_BLOCK_TABLE,
    ScheduledSequence,
    TorchMetadataBuilder,
    block_table_tensor,
    build_model_inputs,
    build_step_layout,
    put_rows,
    take_rows,
)

CPU = torch.device("cpu")
BUILDER = TorchMetadataBuilder(CPU)


def test_prefill_packs_prompts_without_padding():
    layout = build_step_layout(
        [ScheduledSequence([1, 2, 3], 0, [[5]]), ScheduledSequence([4, 5, 6, 7, 8], 0, [[2, 7]])],
        block_size=4,
        max_blocks_per_request=3,
    )
    inputs = build_model_inputs(layout, BUILDER)
    meta = inputs.forward_metadata
    assert inputs.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert inputs.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert meta.groups[0].slot_mapping.tolist() == [20, 21, 22, 8, 9, 10, 11, 28]
    assert meta.query_ends_list == [3, 8] and meta.seq_lens_list == [3, 5]
    assert meta.groups[0].block_table.tolist() == [[5, 0, 0], [2, 7, 0]]
    assert meta.groups[0].block_table.dtype == torch.int32
    assert inputs.logits_indices.tolist() == [2, 7]
    assert meta.query_ends.tolist() == [3, 8] and meta.seq_lens.tolist() == [3, 5]
    assert meta.max_query_len == 5 and not meta.is_decode_shaped


def test_decode_places_each_token_after_its_cached_prefix():
    layout = build_step_layout(
        [ScheduledSequence([9], 4, [[3, 1]]), ScheduledSequence([8], 2, [[6]])], block_size=4, max_blocks_per_request=4
    )
    inputs = build_model_inputs(layout, BUILDER)
    meta = inputs.forward_metadata
    assert inputs.positions.tolist() == [4, 2]
    assert meta.groups[0].slot_mapping.tolist() == [1 * 4 + 0, 6 * 4 + 2]
    assert meta.seq_lens.tolist() == [5, 3] and meta.is_decode_shaped
    assert meta.query_ends_list is None  # the decode op reads tensors only
    assert inputs.logits_indices.tolist() == [0, 1]


def test_each_cache_group_has_its_own_table_and_slots():
    layout = build_step_layout([ScheduledSequence([1, 2], 3, [[4, 5], [9, 2]])], block_size=4, max_blocks_per_request=2)
    meta = BUILDER.build(layout)
    assert [g.block_table.tolist() for g in meta.groups] == [[[4, 5]], [[9, 2]]]
    assert [g.slot_mapping.tolist() for g in meta.groups] == [[19, 20], [39, 8]]


def test_sampled_rows_follow_each_sequence():
    layout = build_step_layout(
        [
            ScheduledSequence([1, 2, 3], 0, [[1]], num_sampled_rows=0),  # a chunk short of its prompt's end
            ScheduledSequence([4, 5, 6], 2, [[2, 3]], num_sampled_rows=3),  # a verify step
            ScheduledSequence([7], 0, [[4]]),
        ],
        block_size=4,
        max_blocks_per_request=2,
    )
    assert layout.logits_indices == [3, 4, 5, 6]


def test_decode_metadata_has_the_same_shapes_whatever_the_longest_sequence():
    def decode_shapes(num_computed: list[int]) -> list[tuple[int, ...]]:
        sequences = [ScheduledSequence([1], n, [list(range(1, n // 16 + 2))]) for n in num_computed]
        inputs = build_model_inputs(build_step_layout(sequences, block_size=16, max_blocks_per_request=64), BUILDER)
        meta = inputs.forward_metadata
        tensors = [
            inputs.input_ids,
            inputs.positions,
            inputs.logits_indices,
            meta.seq_lens,
            meta.groups[0].slot_mapping,
            meta.groups[0].block_table,
        ]
        return [tuple(t.shape) for t in tensors]

    short, long = decode_shapes([3, 5, 1]), decode_shapes([700, 12, 1000])
    assert short == long
    assert short[5] == (3, 64)  # the block table is as wide as max_model_len allows, always


def test_padding_a_decode_step_adds_rows_that_touch_only_the_null_block():
    layout = build_step_layout(
        [ScheduledSequence([9], 4, [[3, 1]]), ScheduledSequence([8], 2, [[6]])], block_size=4, max_blocks_per_request=3
    )
    padded = pad_step(layout, 4)
    inputs = build_model_inputs(padded, BUILDER)
    meta = inputs.forward_metadata
    assert inputs.input_ids.tolist() == [9, 8, 0, 0] and inputs.positions.tolist() == [4, 2, 0, 0]
    assert meta.groups[0].slot_mapping.tolist() == [4, 26, 0, 0]  # padded rows write slot 0 of block 0
    assert meta.groups[0].block_table.tolist() == [[3, 1, 0], [6, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert meta.seq_lens.tolist() == [5, 3, 1, 1] and padded.query_ends == [1, 2, 3, 4]
    assert inputs.logits_indices.tolist() == [0, 1]  # padded rows are never sampled


def test_block_table_tensor_pads_each_row_with_the_null_block():
    table = block_table_tensor([[7, 3], [], [5]], width=4, device=CPU)
    assert table.tolist() == [[7, 3, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0]]
    assert block_table_tensor([], width=4, device=CPU).shape == (0, 4)
    # past SMALL_BLOCK_TABLE entries the table is scattered, not padded as lists: the same values
    block_ids = [list(range(1 + row % 7, 1 + row % 7 + row % 50)) for row in range(SMALL_BLOCK_TABLE // 64 + 8)]
    table = block_table_tensor(block_ids, width=64, device=CPU)
    assert table.dtype == torch.int32 and table.tolist() == [ids + [0] * (64 - len(ids)) for ids in block_ids]


@given(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
def test_rows_taken_and_put_as_indexing_would_a_consecutive_run_through_a_view(rows):
    """take_rows / put_rows are tensor[rows] (= values): a verify step's rows come back as a view of
    the graph's output where they run consecutively (no copy of 32 x 49,152 logits), else gathered."""
    tensor = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    taken = take_rows(tensor, rows)
    assert torch.equal(taken, tensor[rows])
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    assert (taken.data_ptr() == tensor[rows[0]].data_ptr()) == consecutive  # a view exactly when consecutive
    values = -torch.arange(len(rows) * 3, dtype=torch.float32).view(len(rows), 3)
    expected = tensor.clone()
    expected[rows] = values
    put_rows(tensor, rows, values)
    assert torch.equal(tensor, expected)


def test_steps_of_one_structure_differ_in_tensor_values_only():
    """A graph bucket's buffers take a step's inputs only where same_structure holds (copy_step):
    other token ids and blocks pass; another shape, or another value that is no tensor, do not."""

    def inputs(tokens: list[list[int]], blocks: list[list[int]]):
        sequences = [ScheduledSequence(t, 3, [b], num_sampled_rows=1) for t, b in zip(tokens, blocks, strict=True)]
        return build_model_inputs(build_step_layout(sequences, block_size=4, max_blocks_per_request=3), BUILDER)

    step = inputs([[5], [6]], [[1], [2]]).forward_args()
    assert same_structure(step, inputs([[9], [8]], [[4], [3]]).forward_args())
    assert not same_structure(step, inputs([[5], [6], [7]], [[1], [2], [3]]).forward_args())  # three rows
    assert not same_structure(step, inputs([[5, 6], [6, 7]], [[1, 5], [2, 6]]).forward_args())  # 2 tokens a row
    input_ids, positions, metadata = step
    assert not same_structure(step, (input_ids, positions, dataclasses.replace(metadata, max_query_len=2)))
