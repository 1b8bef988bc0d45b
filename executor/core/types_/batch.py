"""Batch: the requests chosen for one step and how many tokens each feeds into it."""

from __future__ import annotations

from dataclasses import dataclass

from executor.core.types_.request import Request


@dataclass(slots=True)
class Batch:
    requests: list[Request]
    # Tokens each request feeds this step, aligned with `requests`: num_tokens - num_computed_tokens,
    # capped by the step's budget (a prompt chunk, a recomputed sequence, one decode token, ...).
    num_scheduled_tokens: list[int]
    is_prefill: bool  # the step's phase, for the log: prefill (prompts or chunks) or decode

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)
