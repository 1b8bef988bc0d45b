"""The whole engine (scheduler, paged KV cache, packed batches) against transformers on a tiny random Llama."""

import json

import pytest
import torch

from executor.types_ import FinishReason
from tests.engine_harness import hf_greedy, load_hf_model, run_engine, token_records

PROMPT_LENGTHS = [1, 5, 17, 33, 8, 64, 3, 40, 12, 90]


def make_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_outputs(tiny_llama_dir) -> list[list[int]]:
    model = load_hf_model(tiny_llama_dir)
    return [hf_greedy(model, prompt, 32) for prompt in make_prompts(PROMPT_LENGTHS)]


def test_batched_greedy_equals_transformers_alone(tiny_llama_dir, hf_outputs):
    result = run_engine(tiny_llama_dir, token_records(make_prompts(PROMPT_LENGTHS)), batch_size=len(PROMPT_LENGTHS))
    assert [r.output_token_ids for r in result.requests] == hf_outputs
    assert result.summary["prefill"]["steps"] == 1  # one packed prefill for the whole batch


def test_pool_smaller_than_the_batch_needs_gives_the_same_outputs(tiny_llama_dir, hf_outputs):
    # block_size 16: the longest request needs 8 blocks; 12 blocks cannot hold the batch at once.
    # (max_model_len 128, so that the pool holds one request of max_model_len, as the engine requires.)
    result = run_engine(
        tiny_llama_dir, token_records(make_prompts(PROMPT_LENGTHS)), batch_size=10, num_blocks=12, max_model_len=128
    )
    assert [r.output_token_ids for r in result.requests] == hf_outputs
    assert all(r.finish_reason is not FinishReason.ERROR for r in result.requests)
    assert result.summary["prefill"]["steps"] > 1  # requests had to wait for blocks


def test_too_long_prompt_fails_alone_with_its_reason(tiny_llama_dir, hf_outputs, tmp_path):
    prompts = make_prompts(PROMPT_LENGTHS[:3]) + make_prompts([300], seed=2)
    result = run_engine(tiny_llama_dir, token_records(prompts), output_dir=tmp_path, batch_size=4, max_model_len=256)
    assert [r.output_token_ids for r in result.requests[:3]] == hf_outputs[:3]
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert len(lines) == 4
    assert by_id["p3"]["finish_reason"] == "error" and "300 tokens" in by_id["p3"]["error"]
    assert by_id["p3"]["output_token_ids"] == []
    assert all(by_id[f"p{i}"]["error"] is None for i in range(3))


def test_batch_of_one_token_prompts_equals_transformers(tiny_llama_dir):
    prompts = make_prompts([1, 1, 1], seed=3)
    model = load_hf_model(tiny_llama_dir)
    result = run_engine(tiny_llama_dir, token_records(prompts), batch_size=3, max_new_tokens=8)
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(model, p, 8) for p in prompts]
