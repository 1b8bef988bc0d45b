"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

Model-free and fit for any model: when the request's last n tokens occurred before in its prompt
or output, the tokens that followed that occurrence are proposed. Longer n-grams are tried first,
and the latest occurrence wins, as vLLM's prompt-lookup decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.core.spec_decode.proposer import ProposalContext


@dataclass(frozen=True, slots=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int
    max_n: int

    def propose_for(self, token_ids: list[int]) -> list[int]:
        """Up to num_speculative_tokens drafts to follow `token_ids`; none when no n-gram recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n  # what followed the latest earlier occurrence
                return tokens[start : start + self.num_speculative_tokens].tolist()
        return []


class NgramStepProposer:
    """Prompt lookup over each request's tokens, this step's included."""

    num_lookahead_tokens = 0  # drafts are looked up, not computed: no K/V written ahead

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram

    def propose(self, context: ProposalContext) -> list[list[int]]:
        return [
            self.ngram.propose_for([*request.prompt_token_ids, *request.output_token_ids, *new]) if new else []
            for request, new in zip(context.requests, context.new_token_ids, strict=True)
        ]

    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        """No forward to match: lookups hold no collective."""
