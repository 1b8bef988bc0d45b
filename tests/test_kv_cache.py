"""BlockPool, the single-type manager and KVCacheManager.allocate_slots."""

import pytest

from executor.core.kv_cache import BlockPool, KVCacheManager
from executor.core.types_ import Request, SamplingParams


def make_request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id, None, list(range(num_prompt_tokens)), SamplingParams())


def test_pool_hands_out_distinct_blocks_and_takes_them_back():
    pool = BlockPool(4)
    first = pool.get_new_blocks(3)
    assert len(set(first)) == 3 and pool.num_free_blocks == 1
    pool.free_blocks(first)
    assert pool.num_free_blocks == 4


def test_pool_reuses_least_recently_freed_block_first():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b])
    pool.free_blocks([a])
    assert pool.get_new_blocks(2) == [b, a]


def test_pool_refuses_more_blocks_than_free_and_double_free():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free_blocks([block])


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_slots_grows_the_block_table_only_at_block_boundaries():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("r", 6)
    assert [len(new) for new in manager.allocate_slots(request, 6)] == [2]
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == [[]]  # tokens 6, 7 fit block 2
    request.num_computed_tokens = 8
    new_blocks = manager.allocate_slots(request, 1)
    assert len(new_blocks[0]) == 1
    assert manager.get_block_ids("r")[-1] == new_blocks[0][0]
    assert len(manager.get_block_ids("r")) == 3


def test_allocate_slots_returns_none_and_allocates_nothing_when_short():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    assert manager.allocate_slots(make_request("a", 8), 8) is not None
    big = make_request("b", 8)
    assert manager.allocate_slots(big, 8) is None
    assert manager.get_block_ids("b") == [] and manager.num_free_blocks == 1


def test_free_returns_every_block_of_the_request():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    request = make_request("r", 7)
    manager.allocate_slots(request, 7)
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    manager.free(request)
    assert manager.num_free_blocks == 4 and manager.get_block_ids("r") == []


def test_requests_never_share_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=2)
    for i in range(5):
        manager.allocate_slots(make_request(str(i), 3), 3)
    all_blocks = [b for i in range(5) for b in manager.get_block_ids(str(i))]
    assert len(all_blocks) == len(set(all_blocks)) == 10
