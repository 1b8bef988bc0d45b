"""Bad words (vLLM's `bad_words`): their token sequences, the bans at each row, and the real default
model never producing a banned word while its greedy output stays the same up to where it would
have (with speculation too, each verify row banning after the drafts before it)."""

from __future__ import annotations

import itertools

import pytest
from transformers import AutoTokenizer

from executor.core.sampler.bad_words import bad_words_token_ids, banned_token_ids
from executor.offline.dataset import PromptRecord
from tests.engine_harness import make_inference

PROMPTS = {
    "france": "The capital of France is the city of",
    "story": "Once upon a time, a little girl named Lily found a",
    "list": "Here are three colours: red, green and",
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_a_word_is_banned_with_and_without_its_leading_space(tokenizer):
    sequences = bad_words_token_ids(["Paris"], tokenizer, tokenizer.vocab_size)
    assert sequences == (
        tuple(tokenizer.encode("Paris", add_special_tokens=False)),
        tuple(tokenizer.encode(" Paris", add_special_tokens=False)),
    )
    assert sequences[0] != sequences[1]


def test_a_word_outside_the_vocabulary_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="bad_words: token id"):
        bad_words_token_ids(["Paris"], tokenizer, vocab_size=10)


def test_the_last_token_is_banned_only_after_the_rest_of_the_word():
    word = (5, 6, 7)
    assert banned_token_ids([word], [1, 5, 6]) == [7]
    assert banned_token_ids([word], [5, 6, 1]) == []
    assert banned_token_ids([word], [6]) == []  # shorter than the word's prefix
    assert banned_token_ids([(9,)], []) == [9]  # a one-token word: always


def generate(smollm2_dir, prompts: dict[str, str], speculative_config=None, **overrides) -> dict[str, list[int]]:
    inference = make_inference(smollm2_dir, speculative_config=speculative_config, max_new_tokens=24, batch_size=4)
    records = [PromptRecord(name, prompt=text, sampling_overrides=dict(overrides)) for name, text in prompts.items()]
    result = inference.generate(records)
    assert all(request.error is None for request in result.requests), [r.error for r in result.requests]
    return {request.request_id: request.output_token_ids for request in result.requests}


def first_occurrence_end(output: list[int], sequences: tuple[tuple[int, ...], ...]) -> int | None:
    """The index of the last token of the first banned sequence in `output`, or None."""
    for end in range(len(output)):
        for sequence in sequences:
            start = end + 1 - len(sequence)
            if start >= 0 and tuple(output[start : end + 1]) == sequence:
                return end
    return None


def phrase_of_several_tokens(output: list[int], tokenizer) -> str:
    """Two neighbouring words of the output, as one banned string: a sequence of several tokens."""
    words = [word.strip(".,!?;:\"'") for word in tokenizer.decode(output).split()]
    for first, second in itertools.pairwise(words):
        phrase = f"{first} {second}"
        spaced = tuple(tokenizer.encode(" " + phrase, add_special_tokens=False))
        if first.isalpha() and second.isalpha() and first_occurrence_end(output[1:], (spaced,)) is not None:
            return phrase
    raise AssertionError(f"no two words in {tokenizer.decode(output)!r}")


@pytest.mark.slow
def test_banned_words_never_appear_and_greedy_output_is_unchanged_until_them(smollm2_dir, tokenizer):
    """Per prompt a word or phrase of its free output ("Paris": one token; two words of the story:
    several): the banned run's tokens equal the free run's up to its last token, differ there, and
    it is nowhere in the banned output."""
    free = generate(smollm2_dir, PROMPTS)
    words = {"france": ["Paris"], "story": [phrase_of_several_tokens(free["story"], tokenizer)]}
    for name, banned in words.items():
        sequences = bad_words_token_ids(banned, tokenizer, tokenizer.vocab_size)
        end = first_occurrence_end(free[name], sequences)
        assert end is not None, (name, banned, tokenizer.decode(free[name]))
        output = generate(smollm2_dir, {name: PROMPTS[name]}, bad_words=tuple(banned))[name]
        assert output[:end] == free[name][:end]
        assert output[end] != free[name][end]
        assert first_occurrence_end(output, sequences) is None
        assert banned[0] not in tokenizer.decode(output)
    assert len(bad_words_token_ids(words["story"], tokenizer, tokenizer.vocab_size)[-1]) >= 2


@pytest.mark.slow
def test_verify_rows_ban_after_the_drafts_before_them(smollm2_dir):
    """n-gram drafts on a text that repeats: the banned run's greedy output with speculation is the
    banned run's without, token for token, so every verify row banned what a one-token step would."""
    prompts = {"repeat": "Repeat this: the red fox jumps over the red fox jumps over the red fox jumps over the"}
    banned = {"bad_words": ("fox",)}
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    plain = generate(smollm2_dir, prompts, **banned)
    assert generate(smollm2_dir, prompts, speculative_config=ngram, **banned) == plain
