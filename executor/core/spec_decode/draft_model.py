"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens greedily.

It runs in an engine of its own (its own runner and KV cache, built by the target's engine). What
the draft model holds of each target request is the proposer's own state, a DraftMirror: the tokens
it was fed and how many of them its cache holds. No Request is changed here (only the scheduler
changes one): each draft forward reads fresh Requests made from the mirrors. Each proposal first
feeds the draft model the tokens it has not seen (the prompt the first time, then the step's
accepted tokens), then k - 1 single-token steps; where the target rejected drafts, the mirror's
computed tokens roll back to what the two agree on, so its K/V is reused up to there and
overwritten after it. When the draft model's own groups span data-parallel replicas (lock-step), a
replica that drafts nothing in a step runs the k idle forwards that meet another replica's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from executor.core.kv_cache import KVCacheManager
from executor.core.sampler.sampler import without_nan_marks
from executor.core.spec_decode.proposer import LockStep, ProposalContext
from executor.types_ import Request, SamplingParams, StepRunner


@dataclass(slots=True)
class DraftMirror:
    """The draft model's view of one target request."""

    target: Request
    token_ids: list[int]  # what the draft model was fed and drafted, in order
    num_computed_tokens: int = 0  # of them, in the draft's KV cache
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=1))

    @property
    def num_unseen_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def as_request(self) -> Request:
        """A throwaway Request over the mirror, for the draft's runner and KV manager to read."""
        return Request(
            self.target.request_id,
            None,
            self.token_ids,
            self.sampling_params,
            num_computed_tokens=self.num_computed_tokens,
        )


class DraftRunner(StepRunner, Protocol):
    def idle_forward(self) -> None:
        """A forward over nothing, that meets the collectives of another replica's (lock-step)."""
        ...


class DraftModelProposer:
    num_lookahead_tokens = 0  # the drafts' K/V goes to the draft model's own cache

    def __init__(
        self,
        runner: DraftRunner,
        kv_cache_manager: KVCacheManager,
        num_speculative_tokens: int,
        lock_step: LockStep | None = None,
    ) -> None:
        """`lock_step`: the draft model's own groups span the replicas (its forwards then match)."""
        self.runner = runner
        self.kv_cache_manager = kv_cache_manager
        self.num_speculative_tokens = num_speculative_tokens
        self.lock_step = lock_step
        self.mirrors: dict[str, DraftMirror] = {}  # by request id

    def propose(self, context: ProposalContext) -> list[list[int]]:
        self._release_finished()
        drafts: list[list[int]] = [[] for _ in context.requests]
        active: list[tuple[int, DraftMirror]] = []
        for index, (request, new_tokens) in enumerate(zip(context.requests, context.new_token_ids, strict=True)):
            if not new_tokens:
                continue
            mirror = self._sync_mirror(request, new_tokens)
            # room for the unseen tokens and the k - 1 drafts fed back
            needed = mirror.num_unseen_tokens + self.num_speculative_tokens - 1
            if self.kv_cache_manager.allocate_slots(mirror.as_request(), needed):
                active.append((index, mirror))
        num_forwards = self._agreed_forwards(self.num_speculative_tokens if active else 0)
        if not active:
            self._idle_forwards(num_forwards)
            return drafts
        num_scheduled = [mirror.num_unseen_tokens for _, mirror in active]
        for depth in range(num_forwards):
            requests = [mirror.as_request() for _, mirror in active]
            batch = self.kv_cache_manager.batch(requests, num_scheduled, is_prefill=depth == 0)
            new = [without_nan_marks(tokens) for tokens in self.runner.execute(batch).new_token_ids]
            for (index, mirror), scheduled, tokens in zip(active, num_scheduled, new, strict=True):
                mirror.num_computed_tokens += scheduled
                mirror.token_ids.extend(tokens)
                drafts[index].extend(tokens)
            num_scheduled = [1] * len(active)
        return drafts

    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        self._idle_forwards(self._agreed_forwards(0))

    def _agreed_forwards(self, num_forwards: int) -> int:
        """Draft forwards this step: this replica's, or in lock-step the most any replica runs (0 or k)."""
        return self.lock_step.max_over_world(num_forwards) if self.lock_step else num_forwards

    def _idle_forwards(self, num_forwards: int) -> None:
        for _ in range(num_forwards):
            self.runner.idle_forward()

    def _sync_mirror(self, request: Request, new_tokens: list[int]) -> DraftMirror:
        """The request's mirror holding the target's tokens so far (its own and this step's), with
        its computed tokens rolled back to the longest prefix it shares with them."""
        tokens = [*request.prompt_token_ids, *request.output_token_ids, *new_tokens]
        mirror = self.mirrors.get(request.request_id)
        if mirror is None:
            mirror = self.mirrors[request.request_id] = DraftMirror(request, tokens)
            return mirror
        agreed = 0
        # the last token is always fed again: its row gives the draft model's next prediction
        limit = min(mirror.num_computed_tokens, len(tokens) - 1)
        while agreed < limit and mirror.token_ids[agreed] == tokens[agreed]:
            agreed += 1
        mirror.token_ids, mirror.num_computed_tokens = tokens, agreed
        return mirror

    def _release_finished(self) -> None:
        """Free the draft K/V of requests the scheduler has finished since the last step."""
        for request_id, mirror in list(self.mirrors.items()):
            if mirror.target.is_finished:
                self.kv_cache_manager.free(mirror.as_request())
                del self.mirrors[request_id]
