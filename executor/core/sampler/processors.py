"""The sampler's stages, each a function over all rows at once: penalties, temperature, top-k and
top-p, min-p. Each returns new logits (float32, -inf where a token is cut) and leaves its input alone."""

from __future__ import annotations

import torch

from executor.core.sampler.metadata import PenaltyInputs

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> torch.Tensor:
    """Repetition penalty first, as transformers' RepetitionPenaltyLogitsProcessor and vLLM do it:
    every token of the prompt or the output has a positive logit divided by the penalty and a
    negative one multiplied. Then frequency and presence penalties, as OpenAI and vLLM define
    them, over the output tokens only: minus frequency x count, minus presence once if present."""
    rows, vocab = logits.shape
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
    seen[penalties.seen_rows, penalties.seen_token_ids] = True
    repetition = penalties.repetition[:, None]
    logits = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
    counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=logits.device)
    ones = torch.ones_like(penalties.output_token_ids, dtype=logits.dtype)
    counts.index_put_((penalties.output_rows, penalties.output_token_ids), ones, accumulate=True)
    return logits - penalties.frequency[:, None] * counts - penalties.presence[:, None] * (counts > 0)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature[:, None]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th kept, as transformers' TopKLogitsWarper),
    then the smallest set of most likely tokens whose probability reaches top_p, renormalised over
    what top-k kept (transformers' TopPLogitsWarper: cut the tokens whose ascending cumulative
    probability stays <= 1 - top_p, never the most likely one). top_k 0 and top_p 1.0 cut nothing."""
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        return _top_k_only(logits, top_k, min(max_top_k, vocab))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    cut = (cumulative <= 1 - top_p[:, None]) & (top_p < 1.0)[:, None]
    cut[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(cut, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort: the largest max_top_k values give every row its k-th value."""
    largest = logits.topk(max_top_k, dim=-1).values
    kth_largest = largest.gather(1, (top_k.clamp(min=1, max=max_top_k) - 1)[:, None])
    kth_largest = torch.where(top_k[:, None] > 0, kth_largest, NEG_INF)
    return logits.masked_fill(logits < kth_largest, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Cut the tokens less likely than min_p times the row's most likely token (transformers'
    MinPLogitsWarper); the ratio does not change with renormalisation, so the earlier cuts do not matter."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, NEG_INF)
