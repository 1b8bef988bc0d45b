"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

Model-free and fit for any model: when the request's last n tokens occurred before in its prompt
or output, the tokens that followed that occurrence are proposed. Longer n-grams are tried first,
and the latest occurrence wins, as vLLM's prompt-lookup decoding does. Each running request keeps an
index of where its n-grams last occurred, grown by the tokens each step adds, so that a lookup costs
a few dict reads whatever the request's length (RequestLookups). PromptLookup puts the same lookup in
front of a model drafter (speculative_config.prompt_lookup).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from executor.core.spec_decode.proposer import ProposalContext
from executor.types_ import Request


@dataclass(slots=True)
class NgramIndex:
    """Tokens and, for every n-gram of min_n..max_n of them, the position after its latest occurrence.
    An n-gram enters once a token follows it, so the tokens' own last n-grams are never their match."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens, after = self.tokens, self._after
        for token in token_ids:
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                after[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def drafts(self, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens that followed the latest earlier occurrence of the longest of the
        tokens' last n-grams that recurs; none when none does."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._after.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + num_tokens]
        return []


@dataclass(frozen=True, slots=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int
    max_n: int

    def index(self, token_ids: Iterable[int] = ()) -> NgramIndex:
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        return index

    def propose_for(self, token_ids: list[int]) -> list[int]:
        """Up to num_speculative_tokens drafts to follow `token_ids`; none when no n-gram recurs."""
        return self.index(token_ids).drafts(self.num_speculative_tokens)


@dataclass(slots=True)
class _Indexed:
    """A request's index: its first `num_own` tokens are the request's, the rest the tokens it emitted
    in the step it was last looked up after (its output once the step is applied, or not: a request
    cut short, or a test)."""

    request: Request
    index: NgramIndex
    num_own: int


@dataclass(slots=True)
class RequestLookups:
    """The lookup after each step for running requests, each through an index of its own tokens that
    grows with them (on a 300-token request a search over all of them took 157 us a step, the
    caches cold after the target's forward); finished requests are forgotten."""

    ngram: NgramProposer
    _indexed: dict[str, _Indexed] = field(default_factory=dict)

    def propose_after(self, request: Request, new_token_ids: list[int]) -> list[int]:
        """Drafts to follow the request's tokens and the ones it emits this step."""
        entry = self._indexed.get(request.request_id)
        if entry is None or not _still_holds(entry, request):
            entry = self._indexed[request.request_id] = _Indexed(request, self.ngram.index(), 0)
        entry.index.extend(request.token_ids_between(len(entry.index.tokens), request.num_tokens))
        entry.num_own = request.num_tokens
        entry.index.extend(new_token_ids)
        return entry.index.drafts(self.ngram.num_speculative_tokens)

    def forget_finished(self) -> None:
        self._indexed = {key: entry for key, entry in self._indexed.items() if not entry.request.is_finished}


def _still_holds(entry: _Indexed, request: Request) -> bool:
    """Whether the tokens indexed past the request's own are what it went on with."""
    indexed = entry.index.tokens
    return (
        len(indexed) <= request.num_tokens
        and request.token_ids_between(entry.num_own, len(indexed)) == indexed[entry.num_own :]
    )


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
    _requests: RequestLookups = field(init=False)

    def __post_init__(self) -> None:
        self._requests = RequestLookups(self.ngram)

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
        self._requests.forget_finished()
        found = {}
        for index in indices:
            request = context.requests[index]
            if drafts := self._requests.propose_after(request, context.new_token_ids[index]):
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
        self._requests = RequestLookups(ngram)

    def propose(self, context: ProposalContext) -> list[list[int]]:
        self._requests.forget_finished()
        return [
            self._requests.propose_after(request, new) if new else []
            for request, new in zip(context.requests, context.new_token_ids, strict=True)
        ]

    def propose_nothing(self, hidden_states: torch.Tensor) -> None:
        """No forward to match: lookups hold no collective."""
