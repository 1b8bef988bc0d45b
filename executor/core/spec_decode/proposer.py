"""One interface for every draft proposer, and the step context it proposes from.

After each step the model runner hands the proposer what it just computed; the proposer returns, for
each request, the draft tokens its next decode step will verify (possibly none). Drafts are
chosen greedily by every proposer, so their distribution is one-hot and rejection sampling needs
no draft probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from executor.types_ import Request
from executor.types_.model_inputs import ScheduledSequence


@dataclass(slots=True)
class ProposalContext:
    """One finished step, as the proposers see it."""

    requests: list[Request]
    sequences: list[ScheduledSequence]  # what each request fed this step (its drafts included)
    new_token_ids: list[list[int]]  # what each request emits this step (not yet appended to it)
    num_valid_tokens: list[int]  # leading fed tokens whose K/V stands (all but rejected drafts)
    hidden_states: torch.Tensor  # the target's [rows, hidden] of this step (graph padding rows after)
    row_starts: list[int]  # first row of each request's sequence


class Proposer(Protocol):
    # KV slots the proposer writes past each step's tokens in the target's cache (MTP: its drafts
    # after the first), which the scheduler allocates with the step's own
    num_lookahead_tokens: int

    def propose(self, context: ProposalContext) -> list[list[int]]:
        """Draft tokens per request of the step, for its next decode step."""
        ...
