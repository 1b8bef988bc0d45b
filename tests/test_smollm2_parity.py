"""The real default model (SmolLM2-135M-Instruct) against transformers on the same weights, fp32."""

import pytest
import torch

from executor.core.types_ import Batch, Request, SamplingParams
from executor.offline.dataset import DATASET_DIR, load_prompts, tokenize_record
from tests.engine_harness import hf_greedy, hf_last_logits, load_hf_model, make_inference, token_records

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
    engine = inference.engine
    requests = [Request(f"p{i}", None, ids, SamplingParams()) for i, ids in enumerate(prompts)]
    for request in requests:
        assert engine.kv_cache_manager.allocate_slots(request, request.num_prompt_tokens) is not None
    batch = Batch(requests, is_prefill=True, num_scheduled_tokens=[r.num_prompt_tokens for r in requests])
    logits = engine.worker.inference(engine._build_model_inputs(batch))
    for request in requests:
        engine.kv_cache_manager.free(request)
    expected = torch.stack([hf_last_logits(hf_model, ids) for ids in prompts])
    assert (logits - expected).abs().max().item() <= 1e-4


def test_batched_greedy_equals_transformers_alone(inference, hf_model, prompts):
    result = inference.generate(token_records(prompts))
    expected = [hf_greedy(hf_model, ids, MAX_NEW_TOKENS) for ids in prompts]
    assert [r.output_token_ids for r in result.requests] == expected
