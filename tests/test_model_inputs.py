"""Packing requests into TND inputs: slot mapping, block table, cumulative and per-request lengths."""

import torch

from executor.core.engine.model_inputs import ScheduledSequence, build_model_inputs

CPU = torch.device("cpu")


def test_prefill_packs_prompts_without_padding():
    inputs = build_model_inputs(
        [ScheduledSequence([1, 2, 3], 0, [5]), ScheduledSequence([4, 5, 6, 7, 8], 0, [2, 7])],
        is_prefill=True,
        block_size=4,
        device=CPU,
    )
    meta = inputs.forward_metadata
    assert inputs.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert inputs.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 8, 9, 10, 11, 28]
    assert meta.actual_seq_lengths_q_list == [3, 8]
    assert meta.actual_seq_lengths_kv_list == [3, 5]
    assert meta.block_table.tolist() == [[5, 0], [2, 7]]
    assert meta.block_table.dtype == torch.int32
    assert meta.selected_token_indices.tolist() == [2, 7]
    assert meta.query_lens == [3, 5] and meta.max_kv_len == 5 and meta.is_prefill


def test_decode_places_each_token_after_its_cached_prefix():
    inputs = build_model_inputs(
        [ScheduledSequence([9], 4, [3, 1]), ScheduledSequence([8], 2, [6])],
        is_prefill=False,
        block_size=4,
        device=CPU,
    )
    meta = inputs.forward_metadata
    assert inputs.position_ids.tolist() == [4, 2]
    assert meta.slot_mapping.tolist() == [1 * 4 + 0, 6 * 4 + 2]
    assert meta.actual_seq_lengths_kv_list == [5, 3]
    assert meta.actual_seq_lengths_q_list == [1, 2]
    assert meta.selected_token_indices.tolist() == [0, 1]


def test_select_all_tokens_selects_every_row():
    inputs = build_model_inputs(
        [ScheduledSequence([1, 2], 3, [0, 1])], is_prefill=False, block_size=4, device=CPU, select_all_tokens=True
    )
    assert inputs.forward_metadata.selected_token_indices.tolist() == [0, 1]
    assert inputs.forward_metadata.slot_mapping.tolist() == [3, 4]


def test_decode_kv_slots_cover_each_request_and_pad_with_a_written_slot():
    inputs = build_model_inputs(
        [ScheduledSequence([9], 4, [3, 1]), ScheduledSequence([8], 1, [6])],
        is_prefill=False,
        block_size=4,
        device=CPU,
    )
    meta = inputs.forward_metadata
    assert meta.decode_kv_slots.tolist() == [[12, 13, 14, 15, 4], [24, 25, 24, 24, 24]]
    assert meta.decode_kv_mask.tolist() == [[True] * 5, [True, True, False, False, False]]


def test_prefill_carries_no_decode_slots():
    meta = build_model_inputs(
        [ScheduledSequence([1, 2], 0, [0])], is_prefill=True, block_size=4, device=CPU
    ).forward_metadata
    assert meta.decode_kv_slots is None and meta.decode_kv_mask is None


def test_a_prefill_of_one_token_prompts_carries_decode_slots():
    meta = build_model_inputs(
        [ScheduledSequence([1], 0, [3]), ScheduledSequence([2], 0, [1])], is_prefill=True, block_size=4, device=CPU
    ).forward_metadata
    assert meta.decode_kv_slots.tolist() == [[12], [4]]
