"""dataset/long_context.jsonl: the shipped long-prefill prompts are 2k to 8k tokens under the
default model's tokenizer, and are what scripts/make_long_context.py writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from executor.offline.dataset import DATASET_DIR, load_prompts, resolve_dataset_path, tokenize_record
from scripts.make_long_context import OUTPUT, generate


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_long_context_is_a_dataset_name() -> None:
    assert resolve_dataset_path("long_context", None, DATASET_DIR) == OUTPUT


@pytest.mark.parametrize("chat", [True, False])
def test_every_prompt_is_2k_to_8k_tokens(tokenizer, chat: bool) -> None:
    records = load_prompts(OUTPUT)
    lengths = {record.id: len(tokenize_record(record, tokenizer, chat)) for record in records}
    assert len(records) >= 10
    assert all(2048 <= n <= 8192 for n in lengths.values()), lengths
    assert OUTPUT.stat().st_size < 1_000_000


def test_the_file_is_what_the_script_writes(tokenizer) -> None:
    assert OUTPUT.read_text(encoding="utf-8") == generate(tokenizer)
