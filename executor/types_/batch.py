"""Batch: the requests chosen for one step and how many tokens each feeds into it."""

from __future__ import annotations

from dataclasses import dataclass, field

from executor.types_.request import Request


@dataclass(slots=True)
class Batch:
    requests: list[Request]
    # Tokens each request feeds this step, aligned with `requests`: num_tokens - num_computed_tokens,
    # capped by the step's budget (a prompt chunk, a recomputed sequence, one decode token, ...).
    num_scheduled_tokens: list[int]
    is_prefill: bool  # the step's phase, for the log: prefill (prompts or chunks) or decode
    # Draft tokens each request feeds after its own (speculative decoding; empty lists when off):
    # the step verifies them, so a request with k drafts feeds num_scheduled_tokens = 1 + k.
    draft_token_ids: list[list[int]] = field(default_factory=list)

    def drafts_of(self, index: int) -> list[int]:
        return self.draft_token_ids[index] if self.draft_token_ids else []

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)
