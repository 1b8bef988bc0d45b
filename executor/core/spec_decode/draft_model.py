"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens greedily.

It runs in an engine of its own (its own runner and KV cache, built by the target's engine) on
shadow requests that mirror the target's tokens: the proposer's private state, not requests of the
run, so it keeps them in step with what its runner returns. Each proposal first feeds the draft
model the tokens it has not seen (the prompt the first time, then the step's accepted tokens), then
k - 1 single-token steps; where the target rejected drafts, the shadow's computed tokens roll back
to what the two agree on, so its K/V is reused up to there and overwritten after it.
"""

from __future__ import annotations

import dataclasses

from executor.core.kv_cache import KVCacheManager
from executor.core.spec_decode.proposer import ProposalContext
from executor.types_ import Batch, Request, SamplingParams, StepRunner


class DraftModelProposer:
    num_lookahead_tokens = 0  # the drafts' K/V goes to the draft model's own cache

    def __init__(self, runner: StepRunner, kv_cache_manager: KVCacheManager, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.kv_cache_manager = kv_cache_manager
        self.num_speculative_tokens = num_speculative_tokens
        self.shadows: dict[str, tuple[Request, Request]] = {}  # request id -> (target request, shadow)

    def propose(self, context: ProposalContext) -> list[list[int]]:
        self._release_finished()
        kv = self.kv_cache_manager
        drafts: list[list[int]] = [[] for _ in context.requests]
        active: list[tuple[int, Request]] = []
        for index, (request, new_tokens) in enumerate(zip(context.requests, context.new_token_ids, strict=True)):
            if not new_tokens:
                continue
            shadow = self._sync_shadow(request, new_tokens)
            # room for the unseen tokens and the k - 1 drafts fed back
            if kv.allocate_slots(
                shadow, shadow.num_tokens - shadow.num_computed_tokens + self.num_speculative_tokens - 1
            ):
                active.append((index, shadow))
        if not active:
            return drafts
        batch = Batch(
            [s for _, s in active], [s.num_tokens - s.num_computed_tokens for _, s in active], is_prefill=True
        )
        for depth in range(self.num_speculative_tokens):
            new = self.runner.execute(batch).new_token_ids
            for (index, shadow), scheduled, tokens in zip(active, batch.num_scheduled_tokens, new, strict=True):
                shadow.num_computed_tokens += scheduled
                shadow.output_token_ids.extend(tokens)
                drafts[index].extend(tokens)
            if depth + 1 < self.num_speculative_tokens:
                batch = Batch([s for _, s in active], [1] * len(active), is_prefill=False)
        return drafts

    def _sync_shadow(self, request: Request, new_tokens: list[int]) -> Request:
        """The request's shadow holding the target's tokens so far (its own and this step's), with
        its computed tokens rolled back to the longest prefix it shares with them."""
        tokens = [*request.prompt_token_ids, *request.output_token_ids, *new_tokens]
        entry = self.shadows.get(request.request_id)
        if entry is None:
            shadow = Request(request.request_id, None, tokens, dataclasses.replace(SamplingParams(), max_new_tokens=1))
            self.shadows[request.request_id] = (request, shadow)
            return shadow
        _, shadow = entry
        seen = shadow.prompt_token_ids + shadow.output_token_ids
        agreed = 0
        # the last token is always fed again: its row gives the draft model's next prediction
        limit = min(shadow.num_computed_tokens, len(tokens) - 1)
        while agreed < limit and seen[agreed] == tokens[agreed]:
            agreed += 1
        shadow.prompt_token_ids, shadow.output_token_ids = tokens, []
        shadow.num_computed_tokens = agreed
        return shadow

    def _release_finished(self) -> None:
        """Free the draft K/V of requests the scheduler has finished since the last step."""
        for request_id, (request, shadow) in list(self.shadows.items()):
            if request.is_finished:
                self.kv_cache_manager.free(shadow)
                del self.shadows[request_id]
