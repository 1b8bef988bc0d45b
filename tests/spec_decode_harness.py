"""The accept counts an n-gram run must report, worked out from its greedy outputs alone.

Speculation leaves greedy output as it is, and n-gram drafts are a function of a request's tokens,
so replaying each request's output through the proposer gives every verify's drafts and how many
of them match: exact counts, whatever the batching, the replicas or the ranks that ran it.
"""

from __future__ import annotations

from collections.abc import Iterable

from executor.core.spec_decode.ngram import NgramProposer
from executor.types_ import AcceptCounts


def ngram_accept_counts(
    requests: Iterable[tuple[list[int], list[int]]], ngram: NgramProposer, max_model_len: int
) -> AcceptCounts:
    """Over (prompt, greedy output) pairs of requests that ran to max_new_tokens (ignore_eos): after
    each step the drafts are looked up in the tokens so far and cut to what the next step may emit
    (the scheduler's rule), and that step accepts them as far as they equal the output."""
    counts = AcceptCounts()
    for prompt, output in requests:
        emitted = 1  # the prefill's token
        while emitted < len(output):
            tokens = [*prompt, *output[:emitted]]
            room = min(len(output) - emitted - 1, max_model_len - len(tokens))
            drafts = ngram.propose_for(tokens)[: max(room, 0)]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[emitted + accepted]:
                accepted += 1
            if drafts:
                counts.add_verify(len(drafts), accepted)
            emitted += accepted + 1
    return counts
