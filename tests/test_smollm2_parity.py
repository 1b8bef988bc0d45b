"""The real default model (SmolLM2-135M-Instruct) against transformers on the same weights, fp32."""

import pytest
import torch

from executor.offline.dataset import DATASET_DIR, load_prompts, tokenize_record
from tests.engine_harness import (
    engine_prefill_logits,
    hf_greedy,
    hf_last_logits,
    load_hf_model,
    make_inference,
    token_records,
)

NUM_PROMPTS = 8
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def inference(smollm2_dir):
    return make_inference(smollm2_dir, batch_size=NUM_PROMPTS, max_new_tokens=MAX_NEW_TOKENS, max_model_len=2048)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    return load_hf_model(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(inference) -> list[list[int]]:
    """Eight chat prompts of the shipped dataset, spread over its range of lengths."""
    tokenized = [tokenize_record(r, inference.tokenizer, True) for r in load_prompts(DATASET_DIR / "default.jsonl")]
    by_length = sorted(tokenized, key=len)
    picks = [by_length[i * (len(by_length) - 1) // (NUM_PROMPTS - 1)] for i in range(NUM_PROMPTS)]
    assert len({len(p) for p in picks}) == NUM_PROMPTS
    return picks


def test_prefill_logits_match_transformers(inference, hf_model, prompts):
    expected = torch.stack([hf_last_logits(hf_model, ids) for ids in prompts])
    assert (engine_prefill_logits(inference, prompts) - expected).abs().max().item() <= 1e-4


def test_bf16_logits_stray_from_fp32_no_more_than_transformers_bf16(smollm2_dir, hf_model, prompts):
    """bf16 is not token-exact (shared/FACTS.md); its error against fp32 must match transformers' own."""
    reference = torch.stack([hf_last_logits(hf_model, ids) for ids in prompts])
    hf_bf16 = load_hf_model(smollm2_dir, torch.bfloat16)
    hf_error = (torch.stack([hf_last_logits(hf_bf16, ids).float() for ids in prompts]) - reference).abs().max()
    ours = engine_prefill_logits(make_inference(smollm2_dir, "bfloat16", max_model_len=2048), prompts)
    our_error = (ours - reference).abs().max()
    assert our_error <= 2 * hf_error, f"ours {our_error:.4f} vs transformers {hf_error:.4f}"


def test_batched_greedy_equals_transformers_alone(inference, hf_model, prompts):
    result = inference.generate(token_records(prompts))
    expected = [hf_greedy(hf_model, ids, MAX_NEW_TOKENS) for ids in prompts]
    assert [r.output_token_ids for r in result.requests] == expected


@pytest.mark.slow
def test_shared_system_prompt_outputs_with_prefix_caching_equal_transformers(smollm2_dir, hf_model):
    """Six prompts of dataset/shared_prefix.jsonl, two at a time, so four reuse the ~820-token prefix."""
    records = load_prompts(DATASET_DIR / "shared_prefix.jsonl")[:6]
    inference = make_inference(smollm2_dir, batch_size=2, max_new_tokens=16, max_model_len=2048)
    prompts = [tokenize_record(r, inference.tokenizer, True) for r in records]
    result = inference.generate(token_records(prompts))
    assert result.summary["prefix_cache_hit_tokens"] >= 4 * 800
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf_model, p, 16) for p in prompts]
