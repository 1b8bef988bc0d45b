"""The one place tests make Requests and word-level tokenizers (tiny models: conftest and the harnesses)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tokenizers import Tokenizer, processors
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from executor.types_ import Request, SamplingParams

TINY_VOCAB = 256  # the tiny tokenizer has a word for every token id of the parity models (paged_harness.VOCAB)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
)


def make_request(
    request_id: str = "r", prompt: Iterable[int] = (1, 2, 3), output: Iterable[int] = (), **params: object
) -> Request:
    """A request of token ids `prompt` (no text), `output` already generated, SamplingParams(**params)."""
    return Request(request_id, None, list(prompt), SamplingParams(**params), output_token_ids=list(output))


def word_tokenizer(
    vocab: Mapping[str, int],
    chat_template: str | None,
    *,
    prepend_bos: bool = False,
    **special_tokens: object,
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `vocab`, built offline; with `prepend_bos`, encoding
    starts with <s> as Llama's does. `special_tokens`: PreTrainedTokenizerFast's (bos_token=...)."""
    backend = Tokenizer(WordLevel(dict(vocab), unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    if prepend_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special_tokens)
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Words w3..w255 plus <unk>, <s>, </s> (ids 0, 1, 2): enough to encode and decode offline."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, TINY_VOCAB)}
    return word_tokenizer(vocab, TINY_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="</s>")
