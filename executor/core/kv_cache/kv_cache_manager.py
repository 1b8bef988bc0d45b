"""KVCacheManager: the scheduler's single door to the paged KV cache.

It speaks in requests and tokens, holds one SingleTypeKVCacheManager per cache group (all drawing
on one BlockPool), checks that every group can allocate before any does, and answers None (not an
exception) when the pool is short so the scheduler can wait or preempt. With prefix caching on it
finds a new request's longest prefix cached in every group (never its last token: that token's
logits must be computed) and caches each full block once its K/V are computed, that is after the
step that computed it, so a request never reads a block another request of the same step has yet
to write. Two requests of one step that computed the same block share one copy from then on.
A request that asks for prompt logprobs takes no prefix hit (a cached position has no logits to
score its next token with), as in vLLM; its blocks are still cached for others.

Layout of one request's blocks in one group (block_size 4, 10 tokens computed, 3 new, 2 lookahead):

    | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 n0 n1 | n2 d0 d1 -- |
      block a       block b       block c       new block d

allocate_slots(request, 3, num_lookahead_tokens=2) hands out block d only; slots for n0..n2 (and
the draft tokens d0, d1 a verify step writes) follow from the table.

A recurrent group (linear attention) holds per-request state slots instead of blocks
(RecurrentStateManager, from `num_state_slots`): a request takes them at its first allocation and
gives them back when freed; its "row" in that group is its slots. Such a state covers the request's
whole prefix, never a block of it, so prefix caching is off for a model with a recurrent group
(`prefix_caching_refusal` says why, for the log).
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.core.kv_cache.block_pool import BlockPool
from executor.core.kv_cache.recurrent_state_manager import RecurrentStateManager
from executor.core.kv_cache.single_type_manager import SingleTypeKVCacheManager, manager_for
from executor.types_.batch import Batch
from executor.types_.kv_cache_spec import KVCacheSpec
from executor.types_.request import Request


@dataclass(slots=True)
class PrefixHit:
    """A waiting request's cached prefix: its row in each group and how many tokens it covers."""

    block_ids: list[list[int]]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What a step's runner needs of the cache's shape to pack a batch (block ids come with the batch)."""

    block_size: int
    num_groups: int
    state_groups: tuple[int, ...]  # groups whose rows are state slots, not blocks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_specs: list[KVCacheSpec],
        enable_prefix_caching: bool = True,
        *,
        num_state_slots: int = 0,
        state_slots_per_request: int = 1,
    ) -> None:
        """`num_state_slots`: slots of each recurrent group's state tensors, the null slot 0 included."""
        assert group_specs, "a KV cache needs at least one cache group"
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.managers: list[SingleTypeKVCacheManager] = [
            RecurrentStateManager(spec, self.block_pool, block_size, group_id, num_state_slots, state_slots_per_request)
            if spec.is_recurrent
            else manager_for(spec, self.block_pool, block_size, group_id)
            for group_id, spec in enumerate(group_specs)
        ]
        # groups whose rows are state slots, not blocks (the step layout packs them so)
        self.state_groups = tuple(group_id for group_id, spec in enumerate(group_specs) if spec.is_recurrent)
        self.prefix_caching_refusal: str | None = None
        if enable_prefix_caching and self.state_groups:
            self.prefix_caching_refusal = (
                "prefix caching is off: the model keeps a recurrent state (linear attention), which covers a "
                "request's whole prefix and is not kept at block boundaries, so no cached block could resume it"
            )
        self.enable_prefix_caching = enable_prefix_caching and not self.state_groups
        self.num_queried_tokens = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens whose K/V were found cached

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def batch(
        self,
        requests: list[Request],
        num_scheduled_tokens: list[int],
        *,
        is_prefill: bool,
        draft_token_ids: list[list[int]] | None = None,
    ) -> Batch:
        """A step's Batch of `requests` (their slots already allocated), carrying their block ids, so
        that the runner never reads this manager."""
        block_ids = [self.get_block_ids(request.request_id) for request in requests]
        return Batch(requests, num_scheduled_tokens, is_prefill, draft_token_ids or [], block_ids)

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(self.block_size, self.num_groups, self.state_groups)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request holding `num_tokens` tokens needs across all cache groups."""
        return sum(manager.num_blocks_for_tokens(num_tokens) for manager in self.managers)

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """The longest prefix of the request cached in every group, short of its last token."""
        no_hit = PrefixHit([[] for _ in self.managers], 0)
        if not self._looks_up(request):
            return no_hit
        block_hashes = request.full_block_hashes(self.block_size)
        num_blocks = min(len(block_hashes), (request.num_tokens - 1) // self.block_size)
        while True:  # each group may only shorten the hit; stop when all agree
            rows = [manager.find_cached_prefix(block_hashes, num_blocks) for manager in self.managers]
            shortest = min(len(row) for row in rows)
            if shortest == num_blocks:
                return PrefixHit(rows, num_blocks * self.block_size) if num_blocks else no_hit
            num_blocks = shortest

    def _looks_up(self, request: Request) -> bool:
        """Whether the request may take a prefix hit: not one that scores its prompt's tokens."""
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def can_admit(self, request: Request, hit: PrefixHit, num_lookahead_tokens: int = 0) -> bool:
        """Whether the free blocks hold the request's tokens beyond its hit, and `num_lookahead_tokens`
        more (cached blocks that no one holds leave the free queue when taken, so they count too), and
        that every recurrent group has its state slots free."""
        if not all(manager.has_state_room(request.request_id) for manager in self.managers):
            return False
        needed = 0
        for manager, row in zip(self.managers, hit.block_ids, strict=True):
            needed += manager.num_blocks_for_tokens(request.num_tokens + num_lookahead_tokens) - len(row)
            needed += sum(1 for block_id in row if block_id and self.block_pool.ref_counts[block_id] == 0)
        return needed <= self.block_pool.num_free_blocks

    def admit(self, request: Request, hit: PrefixHit) -> None:
        """Give the request its cached prefix. The request is left as it is: the scheduler, its one
        writer, starts its computed tokens after the hit (hit.num_tokens)."""
        for manager, row in zip(self.managers, hit.block_ids, strict=True):
            manager.take_cached_blocks(request.request_id, row)
        if self._looks_up(request):
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += hit.num_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens of `request`, plus `num_lookahead_tokens`
        draft tokens a verify step will write; first drop the blocks its window has left behind.

        Returns the newly allocated block ids per cache group (possibly empty lists), or None when
        the pool cannot supply them all (or a recurrent group has no state slots left for a request
        holding none); in that case nothing is allocated.
        """
        for manager in self.managers:
            manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        total_tokens = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = [m.get_num_blocks_to_allocate(request.request_id, total_tokens) for m in self.managers]
        if sum(needed) > self.block_pool.num_free_blocks:
            return None
        if not all(manager.has_state_room(request.request_id) for manager in self.managers):
            return None
        return [m.allocate_new_blocks(request.request_id, total_tokens) for m in self.managers]

    def cache_computed_blocks(self, request: Request) -> None:
        """Cache the request's full blocks whose K/V are computed, for later requests to reuse."""
        if not self.enable_prefix_caching:
            return
        block_hashes = request.full_block_hashes(self.block_size)
        num_full_blocks = min(request.num_computed_tokens // self.block_size, len(block_hashes))
        for manager in self.managers:
            manager.cache_blocks(request.request_id, block_hashes, num_full_blocks)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's row of each group's block table (its state slots in a recurrent group)."""
        return [manager.get_block_ids(request_id) for manager in self.managers]

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks the request holds past its first `num_tokens` tokens: a verify step
        allocated slots for every draft, and those of the rejected ones are no longer needed."""
        for manager in self.managers:
            manager.free_tail(request.request_id, num_tokens)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)
