"""One interface for every draft proposer, and the step context it proposes from.

After each step the model runner hands the proposer what it just computed; the proposer returns, for
each request, the draft tokens its next decode step will verify (possibly none). Drafts are
chosen greedily by every proposer, so their distribution is one-hot and rejection sampling needs
no draft probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from executor.core.config.comm_manager import CommManager
from executor.core.sampler.sampler import without_nan_marks
from executor.types_ import AcceptCounts, Request
from ops.attention.metadata import ScheduledSequence


@dataclass(slots=True)
class ProposalContext:
    """One finished step, as the proposers see it."""

    requests: list[Request]
    sequences: list[ScheduledSequence]  # what each request fed this step (its drafts included)
    new_token_ids: list[list[int]]  # what each request emits this step (not yet appended to it)
    num_valid_tokens: list[int]  # leading fed tokens whose K/V stands (all but rejected drafts)
    hidden_states: torch.Tensor  # the target's [rows, hidden] of this step (graph padding rows after)
    row_starts: list[int]  # first row of each request's sequence
    verified_drafts: list[list[int]] = field(default_factory=list)  # the drafts each request fed this step
    num_accepted_drafts: list[int] = field(default_factory=list)  # of them, how many were accepted
    # filled by a proposer with prompt lookup: this step's verifies of the drafts it looked up
    looked_up: AcceptCounts = field(default_factory=AcceptCounts)

    def __post_init__(self) -> None:
        # A request whose logits held NaN emits the sampler's mark and fails in this step, its drafts unused.
        self.new_token_ids = [without_nan_marks(tokens) for tokens in self.new_token_ids]


@dataclass(frozen=True, slots=True)
class LockStep:
    """Lock-step data parallelism (docs/distributed.md): the proposer's forwards hold collectives
    across the replicas, so in each step every replica runs as many of them as the one that runs
    most (`max_over_world` agrees on it), idle ones where it has fewer or none; `joins_lm_head`: an
    idle forward still calls the LM head, whose group spans the replicas."""

    max_over_world: Callable[[int], int]
    joins_lm_head: bool


class Proposer(Protocol):
    # KV slots the proposer writes past each step's tokens in the target's cache (MTP: its drafts
    # after the first), which the scheduler allocates with the step's own
    num_lookahead_tokens: int

    def propose(self, context: ProposalContext) -> list[list[int]]:
        """Draft tokens per request of the step, for its next decode step."""
        ...

    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        """A step of this replica that drafts for no request (it sampled no row, or was an idle
        forward; `hidden_states`: its target rows, one at least): in lock-step, the idle forwards
        that match the other replicas' proposer forwards; nothing otherwise."""
        ...


class ReplicaSharedDrafts:
    """A proposer whose drafts are its attention TP group's rank 0's, on every rank of the group.
    The drafts decide the tokens each rank feeds next and the KV slots it allocates, so the ranks
    of a group must hold the same ones: they compute them from the same tokens and the same
    all-gathered logits, and one small broadcast per step (CommManager.share_in_replica) makes
    that so by construction rather than by bitwise agreement of their arithmetic."""

    def __init__(self, proposer: Proposer, comm: CommManager, num_speculative_tokens: int) -> None:
        self.proposer = proposer
        self.comm = comm
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = proposer.num_lookahead_tokens

    def propose(self, context: ProposalContext) -> list[list[int]]:
        return self.comm.share_in_replica(self.proposer.propose(context), self.num_speculative_tokens)

    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        self.proposer.propose_nothing(hidden_states)


def drafting_proposer(proposer: Proposer | None) -> Proposer | None:
    """The proposer that drafts, under a ReplicaSharedDrafts (the MTP proposer's graphs are set on it)."""
    return proposer.proposer if isinstance(proposer, ReplicaSharedDrafts) else proposer
