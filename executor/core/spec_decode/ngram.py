"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

Model-free and fit for any model: when the request's last n tokens occurred before in its prompt
or output, the tokens that followed that occurrence are proposed. Longer n-grams are tried first,
and the latest occurrence wins, as vLLM's prompt-lookup decoding does. PromptLookup puts the same
lookup in front of a model drafter (speculative_config.prompt_lookup).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from executor.core.spec_decode.proposer import ProposalContext
from executor.types_ import Request


@dataclass(frozen=True, slots=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int
    max_n: int

    def propose_for(self, token_ids: list[int]) -> list[int]:
        """Up to num_speculative_tokens drafts to follow `token_ids`; none when no n-gram recurs.
        Only the earlier occurrences of the last token can end a match, so they alone are extended
        backwards (a request's tokens are compared once, not once per n: this runs for every request
        after every step)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier match would end
        lengths = np.ones(len(ends), dtype=np.int64)  # of the match ending there, up to max_n
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, min(self.max_n, len(tokens) - 1)):
            before = ends - back
            alive &= before >= 0
            alive[alive] = tokens[before[alive]] == tokens[-1 - back]
            lengths += alive
        n = int(lengths.max(initial=0))
        if n < self.min_n:
            return []
        start = int(ends[np.flatnonzero(lengths >= n)[-1]]) + 1  # what followed the latest longest one
        return tokens[start : start + self.num_speculative_tokens].tolist()

    def propose_after(self, request: Request, new_token_ids: list[int]) -> list[int]:
        """Drafts to follow the request's tokens and the ones it emits this step."""
        return self.propose_for([*request.prompt_token_ids, *request.output_token_ids, *new_token_ids])


@dataclass(slots=True)
class PromptLookup:
    """Prompt lookup in front of a model drafter (speculative_config.prompt_lookup): a request whose
    last n-gram recurs takes the lookup's drafts, the drafter's elsewhere. Where a model repeats
    its prompt or itself (edits, summaries, code, lists), a lookup's drafts are accepted more often than
    a small drafter's and cost no pass; Arctic Inference's suffix decoding falls back to its model
    drafters the same way. It keeps which drafts it gave, to count their verifies apart."""

    ngram: NgramProposer
    # request id -> the request and the drafts last looked up for it, while it runs (a step may leave
    # a request out: a prefill step's does the running ones)
    _given: dict[str, tuple[Request, list[int]]] = field(default_factory=dict)

    def lookups(self, context: ProposalContext, indices: list[int]) -> dict[int, list[int]]:
        """The drafts looked up for the step's requests at `indices` that found a recurring n-gram,
        by index; and the step's verifies of the drafts given last step, counted into
        context.looked_up (a drafter's drafts are the step's others)."""
        verified = zip(context.requests, context.verified_drafts, context.num_accepted_drafts, strict=True)
        for request, drafts, accepted in verified if context.verified_drafts else ():
            _, given = self._given.pop(request.request_id, (request, None))
            if drafts and given is not None and given[: len(drafts)] == drafts:  # cut drafts are a prefix
                context.looked_up.add_verify(len(drafts), accepted)
        self._given = {key: entry for key, entry in self._given.items() if not entry[0].is_finished}
        found = {}
        for index in indices:
            request = context.requests[index]
            if drafts := self.ngram.propose_after(request, context.new_token_ids[index]):
                found[index] = drafts
                self._given[request.request_id] = (request, drafts)
            else:
                self._given.pop(request.request_id, None)
        return found


class NgramStepProposer:
    """Prompt lookup over each request's tokens, this step's included."""

    num_lookahead_tokens = 0  # drafts are looked up, not computed: no K/V written ahead

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram

    def propose(self, context: ProposalContext) -> list[list[int]]:
        return [
            self.ngram.propose_after(request, new) if new else []
            for request, new in zip(context.requests, context.new_token_ids, strict=True)
        ]

    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        """No forward to match: lookups hold no collective."""
