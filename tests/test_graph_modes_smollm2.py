"""The real default model in each graph mode: greedy output equal to eager's on the shipped prompts,
without speculation and, in ge_graph, with n-gram drafts verified in the graphs.

Slow (each bucket of the real model takes one to two minutes to compile on two cores), so marked
slow and run in CI, with one bucket per mode (several buckets, and which steps each serves, are
tests/test_graph_modes.py's, on the tiny model); the graphs go to the default compile cache.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from executor.offline.dataset import DATASET_DIR, PromptRecord, load_prompts, tokenize_record
from tests.engine_harness import make_inference
from tests.test_graph_modes import CACHED_ORIGINS

pytestmark = pytest.mark.slow

SETTINGS = {"batch_size": 6, "graph_buckets": [4], "max_model_len": 1024, "num_blocks": 160}
NUM_PROMPTS = 7  # 7 requests at batch 6: decode steps of 6, 5 (no bucket), then 4 to 1 rows (padded to bucket 4)


def greedy(smollm2_dir, records, speculative_config=None, **model_config) -> tuple[list[list[int]], dict]:
    inference = make_inference(
        smollm2_dir, model_config=model_config, speculative_config=speculative_config, max_new_tokens=24, **SETTINGS
    )
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 6 + 3 * index  # finish at different steps
    result = inference.generate(records)
    return [r.output_token_ids for r in result.requests], result.summary


@pytest.fixture(scope="module")
def records():
    return load_prompts(DATASET_DIR / "default.jsonl")[:NUM_PROMPTS]


def chat_records(smollm2_dir) -> list[PromptRecord]:
    """Chat prompts, then prompts that ask to repeat a text (so that n-gram lookups find drafts, as
    they do once the chat template frames them), as token ids through the template."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = load_prompts(DATASET_DIR / "default.jsonl")[:3] + load_prompts(DATASET_DIR / "repeat_input.jsonl")[:4]
    templated = [tokenize_record(r, tokenizer, apply_chat_template=True) for r in texts]
    return [PromptRecord(id=r.id, prompt_token_ids=ids) for r, ids in zip(texts, templated, strict=True)]


@pytest.mark.parametrize("exe_mode", ["ge_graph", pytest.param("npugraph_ex", marks=pytest.mark.long)])
def test_real_model_graph_mode_equals_eager(exe_mode, smollm2_dir, records):
    """npugraph_ex then runs again and must load every bucket from the cache; ge_graph's warm start
    recompiles (frozen weights bypass inductor's FX-graph cache), which the tiny-model tests cover."""
    eager, _ = greedy(smollm2_dir, records)
    graph, summary = greedy(smollm2_dir, records, exe_mode=exe_mode, enable_cache_compile=True)
    assert graph == eager
    assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0
    if exe_mode == "npugraph_ex":
        again, summary = greedy(smollm2_dir, records, exe_mode=exe_mode, enable_cache_compile=True)
        assert again == eager
        assert set(summary["graph"]["bucket_origins"].values()) == CACHED_ORIGINS[exe_mode]


@pytest.mark.long  # 80 s; n-gram verify steps in graphs stay in CI through tests/test_spec_graphs.py
def test_real_model_with_ngram_in_ge_graph_equals_eager_without_speculation(smollm2_dir):
    """Verify steps of up to 4 requests x (1 + 3) tokens in bucket 4x4's graph, the rest (5 or 6
    requests, prefills) eagerly: the tokens of eager without drafts, with drafts accepted."""
    records = chat_records(smollm2_dir)
    eager, _ = greedy(smollm2_dir, records)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    graph, summary = greedy(smollm2_dir, records, speculative_config=ngram, exe_mode="ge_graph")
    assert graph == eager
    steps = summary["graph"]["graph_steps_per_bucket"]
    assert steps["4x4"] > 0, steps
    assert summary["speculative"]["accepted_tokens"] > 0
