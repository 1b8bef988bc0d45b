"""Batch: the requests chosen for one step, and the write-back of the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

from executor.core.types_.request import Request


@dataclass(slots=True)
class Batch:
    requests: list[Request]
    is_prefill: bool
    # Tokens each request contributes to this step's packed input, aligned with `requests`.
    num_scheduled_tokens: list[int]

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def update_requests_from_batch(self, next_token_ids: list[int]) -> None:
        """Record one sampled token per request and advance its computed-token count."""
        assert len(next_token_ids) == len(self.requests)
        for request, num_tokens, token_id in zip(self.requests, self.num_scheduled_tokens, next_token_ids, strict=True):
            request.num_computed_tokens += num_tokens
            request.output_token_ids.append(token_id)
