"""Batch and StepResult: what the scheduler hands a step, and what the step hands back to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from executor.types_.accept_counts import AcceptCounts
from executor.types_.request import Request, TokenLogprobs


@dataclass(slots=True)
class Batch:
    requests: list[Request]
    # Tokens each request feeds this step, aligned with `requests`: num_tokens - num_computed_tokens,
    # capped by the step's budget (a prompt chunk, a recomputed sequence, one decode token, ...).
    num_scheduled_tokens: list[int]
    is_prefill: bool  # the step's phase, for the log: prefill (prompts or chunks) or decode
    # Draft tokens each request feeds after its own (speculative decoding), aligned with `requests`;
    # empty when no request has any. The step verifies them: a request with k drafts feeds 1 + k tokens.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # Each request's block ids per cache group, as the scheduler allocated them for this step.
    block_ids: list[list[list[int]]] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What one step computed for each request of its batch, aligned with `requests`; the
    scheduler applies it, so that it alone changes a Request."""

    # Tokens each request emits: none for a prompt chunk short of its prompt's end; after a verify
    # step, the accepted drafts and one more token.
    new_token_ids: list[list[int]]
    # Of each request's drafts, how many the step accepted (0 without drafts).
    num_accepted_drafts: list[int]
    # One entry per emitted token for a request whose sampling_params.logprobs is set, else empty.
    logprobs: list[list[TokenLogprobs]]
    # Drafts each request's next decode step verifies; None when the step proposed none (speculation
    # off, or no row sampled), which leaves each request's drafts as they are.
    next_drafts: list[list[int]] | None = None
    # Prompt tokens each request's step scored (SamplingParams.prompt_logprobs), in order, to append
    # to Request.prompt_logprobs; None when no request of the step asked for them.
    prompt_logprobs: list[list[TokenLogprobs]] | None = None
    # Of this step's verifies, those of drafts that prompt lookup gave (speculative_config.prompt_lookup).
    looked_up: AcceptCounts | None = None

    @classmethod
    def empty(cls, num_requests: int) -> StepResult:
        """A step that sampled no row: nothing emitted, accepted or proposed."""
        return cls([[] for _ in range(num_requests)], [0] * num_requests, [[] for _ in range(num_requests)])


class StepRunner(Protocol):
    def execute(self, batch: Batch) -> StepResult:
        """Run one step for `batch`."""
        ...
