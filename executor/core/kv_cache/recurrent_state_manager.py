"""RecurrentStateManager: the state slots of one recurrent cache group (linear attention), per request.

A linear-attention layer keeps a fixed-size state per request (its short-convolution state and its
recurrent state), not K/V per token, so its group holds no blocks: each request takes
`slots_per_request` state slots when it is first allocated (at admission) and keeps them until it
finishes or is preempted. Slot 0 is the null slot, never handed out: padded graph rows read and
write it. The state tensors are [num_slots, *shape] per layer (ModelWorker.init_kv_cache); the
request's row of the group's "block table" is its slots.

Every step reads a request's state from its slot (unless the request starts fresh: no token
computed yet) and writes the state after its last fed token back, so a prompt prefilled in
chunks carries its state from chunk to chunk, and a preempted request, whose slots are freed,
recomputes from a fresh state. With speculative decoding a request holds the 1 + k slots
cann-recipes keeps (1 + next_n), used as a ring: the state after position p lives in its slot
p mod (1 + k), and a verify step keeps the state after each of its positions, so the next step
reads the accepted prefix's (RecurrentStateTables, built in ops/attention/metadata.py): the
manager only hands the slots out and takes them back.

A state describes a whole prefix, not a block, so a recurrent group finds no cached prefix: the
KVCacheManager turns prefix caching off for a model that has one (and says why).
"""

from __future__ import annotations

from executor.core.kv_cache.block_pool import BlockPool
from executor.core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from executor.types_.block_hash import BlockHash
from executor.types_.kv_cache_spec import KVCacheSpec

NULL_STATE_SLOT = 0


class StateSlotPool:
    """The free state slots of one recurrent group; slot 0 (the null slot) is never handed out."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"a state slot pool needs the null slot and at least one more, got {num_slots} slots")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, NULL_STATE_SLOT, -1))  # popped from the end: 1 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"asked for {count} state slots, only {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def give_back(self, slots: list[int]) -> None:
        assert NULL_STATE_SLOT not in slots, "the null slot is never handed out, so never freed"
        assert not set(slots) & set(self._free), f"state slots {slots} freed twice"
        self._free.extend(reversed(slots))


class RecurrentStateManager(SingleTypeKVCacheManager):
    """A request holds `slots_per_request` state slots from its first allocation to its end; no blocks."""

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool: BlockPool,
        block_size: int,
        group_id: int,
        num_slots: int,
        slots_per_request: int = 1,
    ) -> None:
        assert spec.is_recurrent, "a recurrent state manager serves a recurrent spec"
        assert slots_per_request >= 1, "a request needs a slot for its state"
        super().__init__(spec, block_pool, block_size, group_id)
        self.slot_pool = StateSlotPool(num_slots)
        self.slots_per_request = slots_per_request

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        return 0

    def has_state_room(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks or self.slot_pool.num_free_slots >= self.slots_per_request

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Give the request its state slots if it holds none yet; returns no block."""
        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = self.slot_pool.take(self.slots_per_request)
        return []

    def find_cached_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """No prefix is cached: a state is kept for the request's whole prefix, not per block."""
        return []

    def take_cached_blocks(self, request_id: str, block_ids: list[int]) -> None:
        assert not block_ids, "a recurrent group has no cached blocks to take"

    def cache_blocks(self, request_id: str, block_hashes: list[BlockHash], num_full_blocks: int) -> None:
        """Nothing to cache (see find_cached_prefix)."""

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """The slots are the request's for its life; a shorter sequence frees none."""

    def free(self, request_id: str) -> None:
        """Give the request's state slots back (it finished, or was preempted and starts afresh)."""
        self.slot_pool.give_back(self.req_to_blocks.pop(request_id, []))
        self.num_cached_blocks.pop(request_id, None)
