"""Shared fixtures: tiny random Llama model folders (HF format, with a word-level tokenizer) and
the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_VOCAB = 256
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<s>{% endif %}"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Words w3..w255 plus <unk>, <s>, </s> (ids 0, 1, 2): enough to encode and decode offline."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, TINY_VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_llama(path: Path) -> Path:
    """A random HF Llama (GQA, untied) saved as safetensors with a tokenizer: a complete model folder."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, fetched and converted on first use (test.sh does it up front)."""
    from executor.model_loader.default_model import ensure_default_model

    return ensure_default_model()
