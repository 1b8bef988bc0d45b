"""Prefix caching end to end on a tiny random Llama against transformers, and the hard cases that
prefix caches get wrong: a full hit, two requests sharing a prefix in one step, a block evicted
and then needed again, preemption of a request holding shared blocks, a sliding-window request
preempted and recomputed."""

from __future__ import annotations

import pytest
import torch
import transformers

from executor.core.engine import engine as engine_module
from executor.types_ import FinishReason
from tests.conftest import SlidingLlama
from tests.engine_harness import hf_greedy, load_hf_model, make_inference, run_engine, token_records

BLOCK_SIZE = 16  # engine_harness's block size
NEW_TOKENS = 12


def random_tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def shared_prefix_prompts(prefix_len: int, suffix_lens: list[int], seed: int) -> list[list[int]]:
    prefix = random_tokens(prefix_len, seed)
    return [prefix + random_tokens(n, seed + 1 + i) for i, n in enumerate(suffix_lens)]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


def expected(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompts]


def outputs(result) -> list[list[int]]:
    assert all(r.finish_reason is FinishReason.LENGTH for r in result.requests)
    return [r.output_token_ids for r in result.requests]


def test_shared_system_prompt_gives_the_same_outputs_with_caching_on_and_off_and_equals_transformers(
    tiny_llama_dir, hf_model
):
    prompts = shared_prefix_prompts(45, [3, 9, 1, 17, 6, 12, 4, 20], seed=1)
    cached = run_engine(tiny_llama_dir, token_records(prompts), batch_size=2, max_new_tokens=NEW_TOKENS)
    uncached = run_engine(
        tiny_llama_dir, token_records(prompts), batch_size=2, max_new_tokens=NEW_TOKENS, enable_prefix_caching=False
    )
    assert outputs(cached) == outputs(uncached) == expected(hf_model, prompts)
    # The first two share a step and compute the prefix; the six after them reuse its 2 full blocks.
    assert cached.summary["prefix_cache_hit_tokens"] == 6 * 2 * BLOCK_SIZE
    assert uncached.summary["prefix_cache_hit_tokens"] == 0 and uncached.summary["prefix_cache_hit_rate"] == 0.0
    assert cached.summary["prefill"]["mean_ms"] > 0


@pytest.mark.parametrize("prompt_len, hit_tokens", [(32, 16), (33, 32), (16, 0)])
def test_a_prompt_wholly_cached_still_computes_its_last_token(tiny_llama_dir, hf_model, prompt_len, hit_tokens):
    prompt = random_tokens(prompt_len, seed=2)
    result = run_engine(tiny_llama_dir, token_records([prompt, prompt]), batch_size=1, max_new_tokens=NEW_TOKENS)
    assert outputs(result) == expected(hf_model, [prompt]) * 2
    assert result.summary["prefix_cache_hit_tokens"] == hit_tokens


def test_two_requests_sharing_a_prefix_in_one_step_each_compute_it_and_later_ones_share_it(tiny_llama_dir, hf_model):
    prompts = shared_prefix_prompts(40, [5, 7, 2], seed=3)
    inference = make_inference(tiny_llama_dir, batch_size=2, max_new_tokens=NEW_TOKENS)
    result = inference.generate(token_records(prompts))
    assert outputs(result) == expected(hf_model, prompts)
    first_step = result.steps[0]
    assert first_step.phase == "prefill" and first_step.batch_size == 2 and first_step.num_tokens == 45 + 47
    third = next(step for step in result.steps[1:] if step.phase == "prefill")
    assert third.num_tokens == 42 - 2 * BLOCK_SIZE  # the third reuses the prefix's two full blocks


def test_an_evicted_block_is_recomputed_when_needed_again(tiny_llama_dir, hf_model):
    # 9 usable blocks of 16; every request needs 3-4. The first prompt's blocks are freed to the
    # cache, then evicted by the two different ones, then its prefix is asked for again.
    first = random_tokens(40, seed=4)
    others = [random_tokens(40, seed=5), random_tokens(41, seed=6)]
    again = first[:32] + random_tokens(9, seed=7)
    prompts = [first, *others, again]
    result = run_engine(
        tiny_llama_dir,
        token_records(prompts),
        batch_size=2,
        num_blocks=10,
        max_model_len=128,
        max_new_tokens=NEW_TOKENS,
    )
    assert outputs(result) == expected(hf_model, prompts)
    assert result.summary["evictions"] > 0


def test_preempting_a_request_that_holds_shared_blocks_keeps_every_output(tiny_llama_dir, hf_model):
    prompts = shared_prefix_prompts(48, [4, 6, 8, 10], seed=8)
    large = run_engine(tiny_llama_dir, token_records(prompts), batch_size=4, max_new_tokens=40)
    small = run_engine(
        tiny_llama_dir, token_records(prompts), batch_size=4, num_blocks=10, max_model_len=128, max_new_tokens=40
    )
    assert small.summary["preemptions"] > 0 and small.summary["prefix_cache_hit_tokens"] > 0
    assert outputs(small) == outputs(large)


def test_a_sliding_window_request_preempted_and_recomputed_equals_transformers(ministral_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "resolve_model", lambda name: (SlidingLlama, transformers.MinistralConfig))
    prompts = shared_prefix_prompts(20, [5, 14, 9], seed=9)
    inference = make_inference(ministral_dir, batch_size=3, max_new_tokens=30, num_blocks=13, max_model_len=96)
    result = inference.generate(token_records(prompts))
    hf = transformers.MinistralForCausalLM.from_pretrained(ministral_dir, dtype=torch.float32).eval()
    assert result.summary["preemptions"] > 0
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf, p, 30) for p in prompts]
