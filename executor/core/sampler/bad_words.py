"""Bad words (vLLM's `bad_words`): words a request's output must not hold.

Each word becomes token sequences as vLLM's SamplingParams.update_from_tokenizer makes them: the
word as it is (leading spaces stripped) and with one leading space, the second kept only where the
space gives another first token and as many tokens (a word inside a sentence is tokenized with its
space). At each sampled row, a sequence's last token is banned (its logit set to -inf) when the
tokens before that row end with the rest of the sequence: a one-token word is banned always. As
vLLM, "before that row" means the request's output tokens (not its prompt), and in a verify step
also the drafts fed before the row, so each verify row bans what one-token decoding would ban there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_words_token_ids(words: Sequence[str], tokenizer: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (see the module's docstring); ValueError naming the word when
    the tokenizer gives it no token or an id outside the model's vocabulary."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} gives no token")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    outside = [token for sequence in sequences for token in sequence if not 0 <= token < vocab_size]
    if outside:
        raise ValueError(f"bad_words: token id {outside[0]} is outside the model's vocabulary of {vocab_size}")
    return tuple(sequences)


def banned_token_ids(sequences: Sequence[Sequence[int]], past_token_ids: Sequence[int]) -> list[int]:
    """The tokens a row must not sample after `past_token_ids` (its request's output, then the
    drafts before the row): each sequence's last token where the past ends with the sequence's
    others."""
    banned = []
    for sequence in sequences:
        prefix_length = len(sequence) - 1
        if prefix_length > len(past_token_ids):
            continue
        if prefix_length == 0 or list(past_token_ids[-prefix_length:]) == list(sequence[:prefix_length]):
            banned.append(sequence[-1])
    return banned
