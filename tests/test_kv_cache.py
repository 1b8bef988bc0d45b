"""BlockPool (with its null block), the single-type managers and KVCacheManager.allocate_slots."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.core.kv_cache import NULL_BLOCK_ID, BlockPool, KVCacheManager, SlidingWindowManager
from executor.types_ import KVCacheSpec, KVTensorSpec, Request, attention_spec
from executor.types_.kv_cache_spec import AttentionKind
from tests.factories import make_request

FULL = attention_spec(2, 8, torch.float32)
SLIDING = attention_spec(2, 8, torch.float32, sliding_window=8)


def make_manager(num_blocks: int, block_size: int, specs: list[KVCacheSpec] | None = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, specs or [FULL])


def test_pool_hands_out_distinct_blocks_and_takes_them_back():
    pool = BlockPool(5)
    first = pool.get_new_blocks(3)
    assert len(set(first)) == 3 and pool.num_free_blocks == 1
    pool.free_blocks(first)
    assert pool.num_free_blocks == 4 == pool.num_usable_blocks


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(4)
    assert NULL_BLOCK_ID not in pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)


def test_pool_reuses_least_recently_freed_block_first():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b])
    pool.free_blocks([a])
    assert pool.get_new_blocks(2) == [b, a]


def test_pool_refuses_more_blocks_than_free_and_double_free():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free_blocks([block])


def test_pool_needs_a_block_beside_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)


def test_allocate_slots_grows_the_block_table_only_at_block_boundaries():
    manager = make_manager(num_blocks=8, block_size=4)
    request = make_request("r", range(6))
    assert [len(new) for new in manager.allocate_slots(request, 6)] == [2]
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == [[]]  # tokens 6, 7 fit block 2
    request.num_computed_tokens = 8
    new_blocks = manager.allocate_slots(request, 1)
    assert len(new_blocks[0]) == 1
    assert manager.get_block_ids("r")[0][-1] == new_blocks[0][0]
    assert len(manager.get_block_ids("r")[0]) == 3


def test_lookahead_tokens_get_slots_too():
    manager = make_manager(num_blocks=8, block_size=4)
    request = make_request("r", range(4))
    request.num_computed_tokens = 3
    assert [len(new) for new in manager.allocate_slots(request, 1, num_lookahead_tokens=3)] == [2]


def test_allocate_slots_returns_none_and_allocates_nothing_when_short():
    manager = make_manager(num_blocks=4, block_size=4)
    assert manager.allocate_slots(make_request("a", range(8)), 8) is not None
    big = make_request("b", range(8))
    assert manager.allocate_slots(big, 8) is None
    assert manager.get_block_ids("b") == [[]] and manager.num_free_blocks == 1


def test_free_returns_every_block_of_the_request():
    manager = make_manager(num_blocks=5, block_size=2)
    request = make_request("r", range(7))
    manager.allocate_slots(request, 7)
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    manager.free(request)
    assert manager.num_free_blocks == 4 and manager.get_block_ids("r") == [[]]


def test_requests_never_share_blocks():
    manager = make_manager(num_blocks=11, block_size=2)
    for i in range(5):
        manager.allocate_slots(make_request(str(i), range(3)), 3)
    all_blocks = [b for i in range(5) for b in manager.get_block_ids(str(i))[0]]
    assert len(all_blocks) == len(set(all_blocks)) == 10


def test_each_cache_group_gets_its_own_blocks_and_table_row():
    manager = make_manager(num_blocks=11, block_size=4, specs=[FULL, SLIDING])
    assert isinstance(manager.managers[1], SlidingWindowManager)
    request = make_request("r", range(9))
    assert manager.num_blocks_for_tokens(9) == 6  # 3 blocks in each group
    assert [len(new) for new in manager.allocate_slots(request, 9)] == [3, 3]
    full_row, sliding_row = manager.get_block_ids("r")
    assert not set(full_row) & set(sliding_row)


def test_the_sliding_window_group_frees_blocks_the_window_has_left_and_nulls_them_in_the_row():
    manager = make_manager(num_blocks=20, block_size=4, specs=[FULL, SLIDING])  # window 8
    request = make_request("r", range(20))
    manager.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    free_before = manager.num_free_blocks
    manager.allocate_slots(request, 1)  # the query at position 20 sees keys 13..20: blocks 3.. only
    full_row, sliding_row = manager.get_block_ids("r")
    assert len(full_row) == len(sliding_row) == 6 and NULL_BLOCK_ID not in full_row
    assert sliding_row[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in sliding_row[3:]
    assert manager.num_free_blocks == free_before - 2 + 3  # one new block per group, three freed
    manager.free(request)
    assert manager.num_free_blocks == 19


def test_a_sliding_window_hit_needs_only_the_window_cached():
    manager = make_manager(num_blocks=30, block_size=4, specs=[SLIDING])  # window 8
    first = make_request("a", range(26))
    manager.admit(first, manager.find_prefix_hit(first))
    manager.allocate_slots(first, 26)
    first.num_computed_tokens = 26
    manager.cache_computed_blocks(first)
    manager.allocate_slots(first, 1)  # frees blocks 0..3, which stay cached in the free queue
    manager.block_pool.get_new_blocks(manager.num_free_blocks)  # ... until every free block is evicted
    second = make_request("b", [*range(26), 99])
    hit = manager.find_prefix_hit(second)
    # 24 tokens = 6 full blocks, and a query at position 24 sees keys 17..24: blocks 4 and 5 suffice.
    assert hit.num_tokens == 24 and hit.block_ids[0][:4] == [NULL_BLOCK_ID] * 4
    assert hit.block_ids[0][4:] == manager.get_block_ids("a")[0][4:6]


def test_two_requests_that_computed_the_same_prefix_in_one_step_then_share_one_copy():
    manager = make_manager(num_blocks=20, block_size=4)
    first, second = make_request("a", range(10)), make_request("b", range(10))  # tokens 0..9 both
    for request in (first, second):
        manager.admit(request, manager.find_prefix_hit(request))  # nothing cached yet: no hit
        manager.allocate_slots(request, 10)
        request.num_computed_tokens = 10
    assert not set(manager.get_block_ids("a")[0]) & set(manager.get_block_ids("b")[0])
    free_before = manager.num_free_blocks
    for request in (first, second):  # after the step that computed them
        manager.cache_computed_blocks(request)
    (a_row,), (b_row,) = manager.get_block_ids("a"), manager.get_block_ids("b")
    assert b_row[:2] == a_row[:2] and b_row[2] != a_row[2]  # the two full blocks are shared
    assert manager.num_free_blocks == free_before + 2
    assert [manager.block_pool.ref_counts[b] for b in a_row] == [2, 2, 1]


def test_a_group_short_of_blocks_stops_every_group_from_allocating():
    manager = make_manager(num_blocks=6, block_size=4, specs=[FULL, SLIDING])
    assert manager.allocate_slots(make_request("r", range(12)), 12) is None  # 3 + 3 blocks needed, 5 usable
    assert manager.num_free_blocks == 5


def test_an_mla_latent_spec_is_sized_by_its_latent():
    latent = KVCacheSpec((KVTensorSpec("kv_latent", (512 + 64,), torch.bfloat16),))
    assert latent.bytes_per_block(128) == 128 * 576 * 2
    assert FULL.bytes_per_block(16) == 16 * 2 * (2 * 8) * 4


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(2, 20),
    block_size=st.sampled_from([1, 2, 4]),
    two_groups=st.booleans(),
    caching=st.booleans(),
    prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=9), min_size=1, max_size=5),
    actions=st.lists(
        st.tuples(st.sampled_from(["admit", "append", "finish", "preempt"]), st.integers(0, 4)), max_size=60
    ),
)
def test_random_admit_append_finish_and_preempt_keep_the_pool_consistent(
    num_blocks, block_size, two_groups, caching, prompts, actions
):
    """Prompts over two tokens share prefixes often, so hits, shared blocks and evictions are common."""
    specs = [FULL, KVCacheSpec(FULL.tensors, AttentionKind.SLIDING_WINDOW, sliding_window=3)] if two_groups else [FULL]
    manager = KVCacheManager(num_blocks, block_size, specs, enable_prefix_caching=caching)
    pool = manager.block_pool
    requests = [make_request(str(i), prompt) for i, prompt in enumerate(prompts)]
    running: set[int] = set()

    def compute(request: Request, num_tokens: int) -> bool:
        if manager.allocate_slots(request, num_tokens) is None:
            return False
        request.num_computed_tokens += num_tokens
        manager.cache_computed_blocks(request)
        return True

    for action, index in actions:
        request = requests[index % len(requests)]
        rid = int(request.request_id)
        if action == "admit" and rid not in running:
            hit = manager.find_prefix_hit(request)
            assert hit.num_tokens < request.num_tokens, "a hit never covers the last token"
            if manager.can_admit(request, hit):
                manager.admit(request, hit)
                request.num_computed_tokens = hit.num_tokens  # the scheduler's part
                assert compute(request, request.num_tokens - request.num_computed_tokens), "admitted, so it fits"
                running.add(rid)
        elif action == "append" and rid in running:
            request.output_token_ids.append(1 + len(request.output_token_ids) % 2)
            if not compute(request, 1):
                request.output_token_ids.pop()
        elif action in ("finish", "preempt") and rid in running:
            manager.free(request)
            request.num_computed_tokens = 0
            running.discard(rid)
            if action == "finish":
                request.output_token_ids.clear()

        holders = [0] * num_blocks
        for held in running:
            for row in manager.get_block_ids(str(held)):
                for block_id in row:
                    holders[block_id] += block_id != NULL_BLOCK_ID
        free = pool.free_block_ids()
        assert NULL_BLOCK_ID not in free and pool.ref_counts[NULL_BLOCK_ID] == 0
        assert pool.ref_counts == holders, "reference counts equal the block tables holding each block"
        assert sorted(free) == [b for b in range(1, num_blocks) if holders[b] == 0], "free exactly when unheld"
        for key, block_id in pool.cached_blocks.items():
            assert pool.cache_keys[block_id] == key and len(key[1].token_ids) == block_size
        for held in running:  # every cached block a request holds hashes that request's own tokens
            request = requests[held]
            for group, row in enumerate(manager.get_block_ids(request.request_id)):
                for position, block_id in enumerate(row):
                    key = pool.cache_keys[block_id] if block_id != NULL_BLOCK_ID else None
                    if key is not None:
                        start = position * block_size
                        assert key == (group, request.block_hashes[position])
                        assert key[1].token_ids == tuple(request.token_ids_between(start, start + block_size))
    for held in list(running):
        manager.free(requests[held])
    assert pool.num_free_blocks == num_blocks - 1 and all(count == 0 for count in pool.ref_counts), "nothing leaks"


def test_admitting_a_prefix_hit_leaves_the_request_to_the_scheduler():
    """The manager hands the request its cached blocks and reports how many tokens they hold; it
    does not write the request (the scheduler, its one writer, starts its computed tokens there)."""
    manager = make_manager(num_blocks=20, block_size=4)
    first = make_request("a", range(10))
    manager.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    manager.cache_computed_blocks(first)
    second = make_request("b", range(10))
    hit = manager.find_prefix_hit(second)
    manager.admit(second, hit)
    assert hit.num_tokens == 8 and second.num_computed_tokens == 0
    assert manager.get_block_ids("b")[0] == manager.get_block_ids("a")[0][:2]
