"""Verifying a request's draft tokens against the target model's rows of one verify step.

A request with k drafts feeds k + 1 tokens (its last token, then the drafts) and gets k + 1 rows
of target logits: row j is the target's distribution for the token after draft j - 1. Greedy
requests keep the longest prefix of drafts that equal the target's argmax and then the target's own
token (the bonus token when every draft passed), so the output is exactly greedy decoding's.
Random requests use rejection sampling (Leviathan et al. 2023), which leaves the target's
distribution unchanged whatever the drafts.
"""

from __future__ import annotations

import torch


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The tokens a greedy request emits: drafts up to the first that differs from the target's
    choice at its row, then the target's token there; all drafts and a bonus token if none differs."""
    assert len(target_token_ids) == len(draft_token_ids) + 1, "one target row per draft, plus the bonus row"
    for index, draft in enumerate(draft_token_ids):
        if target_token_ids[index] != draft:
            return [*draft_token_ids[:index], target_token_ids[index]]
    return [*draft_token_ids, target_token_ids[-1]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a random request emits from one verify step.

    target_probs [k + 1, vocab] is the target's processed distribution at each row, draft_probs
    [k, vocab] the proposer's (None for a deterministic proposer: n-gram, or greedy drafting, whose
    distribution is one-hot on its draft). Draft j is accepted with probability min(1, p/q); at the
    first rejection the token is drawn from max(0, p - q) renormalised and the rest dropped; when all
    pass, one bonus token is drawn from the last row.
    """
    for index, draft in enumerate(draft_token_ids):
        p = target_probs[index]
        q = draft_probs[index] if draft_probs is not None else _one_hot(draft, p)
        accept_probability = torch.clamp(p[draft] / q[draft], max=1.0)
        if torch.rand((), generator=generator, device=p.device) < accept_probability:
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        # p == q on the whole support leaves nothing to resample from; rejection then had probability 0
        recovered = residual / total if total > 0 else p
        token = int(torch.multinomial(recovered, 1, generator=generator))
        return [*draft_token_ids[:index], token]
    bonus = int(torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator))
    return [*draft_token_ids, bonus]


def _one_hot(token_id: int, like: torch.Tensor) -> torch.Tensor:
    one_hot = torch.zeros_like(like)
    one_hot[token_id] = 1.0
    return one_hot
