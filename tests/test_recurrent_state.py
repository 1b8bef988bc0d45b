"""The recurrent-state cache mechanism: a recurrent spec's bytes, RecurrentStateManager's slots
(taken at admission, kept across chunks, freed at the end or on preemption, 1 + next_n per request
where asked), prefix caching refused with its reason, and the step layout and metadata a recurrent
group gets (each row's slot, whether it continues a state, padded rows on the null slot)."""

from __future__ import annotations

import pytest
import torch

from executor.core.kv_cache import NULL_STATE_SLOT, KVCacheManager, RecurrentStateManager, StateSlotPool
from executor.core.model_worker.bucket_padding import pad_step, padding_step
from executor.core.scheduler import Scheduler, SchedulerLimits
from executor.types_ import KVTensorSpec, attention_spec, recurrent_spec
from ops.attention.metadata import (
    RecurrentStateTables,
    ScheduledSequence,
    TorchMetadataBuilder,
    build_step_layout,
)
from tests.factories import make_request

FULL = attention_spec(2, 8, torch.float32)
STATES = recurrent_spec(
    KVTensorSpec("conv_state", (3, 16), torch.float32), KVTensorSpec("recurrent_state", (2, 4, 4), torch.float32)
)
BLOCK_SIZE = 4


def hybrid_manager(num_blocks: int = 16, num_state_slots: int = 3, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, [FULL, STATES], num_state_slots=num_state_slots, **kwargs)


def test_a_recurrent_spec_takes_no_bytes_per_token_and_its_states_per_slot():
    assert STATES.is_recurrent and not FULL.is_recurrent
    assert STATES.bytes_per_token == 0 and STATES.bytes_per_block(BLOCK_SIZE) == 0
    assert STATES.bytes_per_slot == (3 * 16 + 2 * 4 * 4) * 4
    assert FULL.bytes_per_slot == 0


def test_slot_pool_never_hands_out_the_null_slot_and_refuses_a_double_free():
    pool = StateSlotPool(3)
    slots = pool.take(2)
    assert NULL_STATE_SLOT not in slots and sorted(slots) == [1, 2]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.take(1)
    pool.give_back(slots)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.give_back(slots[:1])


def test_a_request_takes_its_slot_at_admission_keeps_it_across_chunks_and_frees_it_at_the_end():
    manager = hybrid_manager()
    states = manager.managers[1]
    request = make_request("a", prompt=range(10))
    hit = manager.find_prefix_hit(request)
    assert manager.can_admit(request, hit)
    manager.admit(request, hit)
    assert manager.allocate_slots(request, 6) == [[1, 2], []]  # blocks for the first chunk; no block for states
    (slot,) = manager.get_block_ids("a")[1]
    request.num_computed_tokens = 6
    manager.allocate_slots(request, 4)
    assert manager.get_block_ids("a")[1] == [slot]  # the next chunk continues the same state
    assert states.slot_pool.num_free_slots == 1
    manager.free(request)
    assert states.slot_pool.num_free_slots == 2 and manager.get_block_ids("a")[1] == []


def test_blocks_are_counted_for_the_paged_groups_only():
    manager = hybrid_manager()
    assert manager.num_blocks_for_tokens(9) == 3  # the full group's; the state group needs none


def test_a_request_waits_when_every_state_slot_is_taken():
    manager = hybrid_manager(num_state_slots=2)  # the null slot and one more
    first, second = make_request("a"), make_request("b")
    manager.admit(first, manager.find_prefix_hit(first))
    assert manager.allocate_slots(first, 3) is not None
    assert not manager.can_admit(second, manager.find_prefix_hit(second))
    assert manager.allocate_slots(second, 3) is None
    assert manager.block_pool.num_used_blocks == 1  # nothing allocated for the refused request
    manager.free(first)
    assert manager.allocate_slots(second, 3) is not None


def test_draft_slots_give_each_request_one_plus_next_n_slots():
    manager = hybrid_manager(num_state_slots=7, state_slots_per_request=3)
    request = make_request("a")
    manager.allocate_slots(request, 3)
    assert len(manager.get_block_ids("a")[1]) == 3
    assert manager.managers[1].slot_pool.num_free_slots == 3
    manager.free_tail(request, 3)  # a verify step's tail: the state slots stay
    assert len(manager.get_block_ids("a")[1]) == 3


def test_prefix_caching_is_refused_for_a_model_with_a_recurrent_group_with_the_reason():
    manager = hybrid_manager(enable_prefix_caching=True)
    assert not manager.enable_prefix_caching
    assert "recurrent state" in manager.prefix_caching_refusal
    request = make_request("a", prompt=range(12))
    manager.allocate_slots(request, 12)
    request.num_computed_tokens = 12
    manager.cache_computed_blocks(request)
    again = make_request("b", prompt=range(12))
    assert manager.find_prefix_hit(again).num_tokens == 0
    assert KVCacheManager(8, BLOCK_SIZE, [FULL]).prefix_caching_refusal is None


def test_preemption_frees_the_slot_and_the_recompute_starts_fresh():
    manager = hybrid_manager(num_blocks=5, num_state_slots=3)
    scheduler = Scheduler(SchedulerLimits(2, 64, 64), manager, set())
    older = make_request("old", prompt=range(8), max_new_tokens=2)
    newer = make_request("new", prompt=range(7), max_new_tokens=2)
    for request in (older, newer):
        scheduler.add_request(request)
    batch = scheduler._schedule_prefill_batch()
    assert batch is not None and len(batch.requests) == 2
    older.num_computed_tokens, newer.num_computed_tokens = 8, 7
    older.output_token_ids.append(1)
    newer.output_token_ids.append(1)
    assert scheduler._allocate_or_preempt(older, 1, 0)  # older needs a third block: newer is preempted
    assert newer.num_computed_tokens == 0 and scheduler.waiting[0] is newer
    assert manager.get_block_ids("new") == [[], []]
    assert manager.managers[1].slot_pool.num_free_slots == 1


def sequences() -> list[ScheduledSequence]:
    return [
        ScheduledSequence(token_ids=[5, 6, 7], num_computed_tokens=0, block_ids=[[3], [2]]),
        ScheduledSequence(token_ids=[8, 9], num_computed_tokens=4, block_ids=[[1, 4], [1]]),
    ]


def test_the_layout_keeps_each_rows_state_slot_and_whether_it_continues_a_state():
    layout = build_step_layout(sequences(), block_size=BLOCK_SIZE, max_blocks_per_request=4, state_groups=(1,))
    assert layout.block_ids[1] == [[2], [1]] and layout.slot_mappings[1] == []
    assert layout.slot_mappings[0] == [12, 13, 14, 16, 17]
    assert layout.has_initial_state == [False, True]
    metadata = TorchMetadataBuilder(torch.device("cpu")).build(layout)
    tables = metadata.groups[1]
    assert isinstance(tables, RecurrentStateTables)
    assert tables.state_slots.tolist() == [2, 1] and tables.has_initial_state.tolist() == [False, True]
    assert tables.query_ends_list == [3, 5]


def test_padded_decode_rows_read_and_write_the_null_slot_from_zeros():
    decode = [ScheduledSequence(token_ids=[9], num_computed_tokens=5, block_ids=[[1, 4], [2]])]
    layout = build_step_layout(decode, block_size=BLOCK_SIZE, max_blocks_per_request=4, state_groups=(1,))
    padded = pad_step(layout, 3)
    tables = TorchMetadataBuilder(torch.device("cpu")).build(padded).groups[1]
    assert tables.state_slots.tolist() == [2, NULL_STATE_SLOT, NULL_STATE_SLOT]
    assert tables.has_initial_state.tolist() == [True, False, False]
    assert tables.query_ends_list is None  # decode-shaped: shapes depend on the rows alone
    buffers = TorchMetadataBuilder(torch.device("cpu")).build(padding_step(3, 2, 4, state_groups=(1,)))
    assert buffers.groups[1].state_slots.shape == tables.state_slots.shape


def test_the_recurrent_manager_serves_recurrent_specs_only():
    with pytest.raises(AssertionError, match="recurrent spec"):
        RecurrentStateManager(FULL, hybrid_manager().block_pool, BLOCK_SIZE, 0, num_slots=3)


def test_a_request_with_draft_slots_uses_them_as_a_ring_keeping_a_verify_steps_states_per_position():
    """Three slots [4, 5, 6]: the state after position p lives in slot p mod 3. A verify row at
    positions 5..7 reads the state after 4 (slot 5) and keeps each position's (6, 4, 5); a prompt
    chunk longer than the ring keeps its final state only."""
    verify = ScheduledSequence(token_ids=[1, 2, 3], num_computed_tokens=5, block_ids=[[1, 2], [4, 5, 6]])
    chunk = ScheduledSequence(token_ids=list(range(7)), num_computed_tokens=0, block_ids=[[3, 7], [8, 9, 10]])
    layout = build_step_layout([verify, chunk], block_size=BLOCK_SIZE, max_blocks_per_request=4, state_groups=(1,))
    tables = TorchMetadataBuilder(torch.device("cpu")).build(layout).groups[1]
    assert tables.state_slots.tolist() == [5, 10]  # the chunk starts fresh; its read slot is unused
    assert tables.position_state_slots == [[6, 4, 5], None]
    assert tables.final_state_slots.tolist() == [5, 8]  # after position 7 (7 mod 3 = 1), after position 6 (0)
    decode = ScheduledSequence(token_ids=[9], num_computed_tokens=7, block_ids=[[1, 2], [4, 5, 6]])
    layout = build_step_layout([decode], block_size=BLOCK_SIZE, max_blocks_per_request=4, state_groups=(1,))
    tables = TorchMetadataBuilder(torch.device("cpu")).build(layout).groups[1]
    assert tables.state_slots.tolist() == [4] and tables.final_state_slots.tolist() == [5]
