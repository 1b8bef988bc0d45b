"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token scored teacher forced,
against transformers' log-softmax of its own logits on the tiny random Llama."""

import json

import pytest
import torch

from executor.core.kv_cache import KVCacheManager
from executor.offline.dataset import PromptRecord
from executor.offline.offline_inference import RunResult
from executor.types_ import Request, TokenLogprobs, attention_spec
from tests.engine_harness import load_hf_model, make_inference, run_engine
from tests.factories import make_request

NUM_TOP = 3
TOLERANCE = 1e-4
PROMPT_LENGTHS = [1, 5, 17, 40]
SHARED_PREFIX_LEN = 35  # over two full blocks of 16


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def scored(prompt_id: str, prompt: list[int], num_top: int = NUM_TOP) -> PromptRecord:
    return PromptRecord(id=prompt_id, prompt_token_ids=prompt, sampling_overrides={"prompt_logprobs": num_top})


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir) -> torch.nn.Module:
    return load_hf_model(tiny_llama_dir)


@torch.inference_mode()
def check_against_transformers(hf_model: torch.nn.Module, request: Request, num_top: int = NUM_TOP) -> None:
    """Entry i scores prompt token i + 1 under transformers' fp32 log-softmax at position i."""
    prompt = request.prompt_token_ids
    logprobs = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    assert len(request.prompt_logprobs) == len(prompt) - 1, request.request_id
    for position, entry in enumerate(request.prompt_logprobs):
        expected_top, expected_ids = logprobs[position].topk(num_top)
        assert entry.token_id == prompt[position + 1]
        assert abs(entry.logprob - logprobs[position, entry.token_id].item()) < TOLERANCE, (
            request.request_id,
            position,
        )
        assert entry.top_token_ids == expected_ids.tolist(), (request.request_id, position)
        assert torch.allclose(torch.tensor(entry.top_logprobs), expected_top, atol=TOLERANCE, rtol=0)


def by_id(result: RunResult) -> dict[str, Request]:
    return {request.request_id: request for request in result.requests}


def test_prompt_logprobs_equal_transformers_log_softmax_of_the_same_prompt(tiny_llama_dir, hf_model):
    records = [scored(f"p{i}", random_prompt(n, seed=i)) for i, n in enumerate(PROMPT_LENGTHS)]
    result = run_engine(tiny_llama_dir, records, batch_size=len(records), max_new_tokens=2)
    assert result.summary["prefill"]["steps"] == 1
    for request in result.requests:
        check_against_transformers(hf_model, request)


def test_chunked_prefill_gathers_prompt_logprobs_across_chunks(tiny_llama_dir, hf_model):
    """Chunks of 7 tokens: each chunk's last row scores the next chunk's first token."""
    records = [scored(f"p{i}", random_prompt(n, seed=i)) for i, n in enumerate(PROMPT_LENGTHS)]
    result = run_engine(tiny_llama_dir, records, batch_size=len(records), max_new_tokens=2, max_prefill_tokens=7)
    assert result.summary["prefill"]["steps"] > 5
    for request in result.requests:
        check_against_transformers(hf_model, request)


def test_a_request_with_prompt_logprobs_takes_no_prefix_hit_but_others_still_do(tiny_llama_dir, hf_model):
    """One request at a time: `warm` caches the shared prefix; `scored` computes its whole prompt
    anyway (its own result as without the cache); `later` hits the blocks both left."""
    prefix = random_prompt(SHARED_PREFIX_LEN, seed=7)
    records = [
        PromptRecord(id="warm", prompt_token_ids=prefix + random_prompt(4, seed=8)),
        scored("scored", prefix + random_prompt(6, seed=9)),
        PromptRecord(id="later", prompt_token_ids=prefix + random_prompt(5, seed=10)),
    ]
    cached = run_engine(tiny_llama_dir, records, batch_size=1, max_new_tokens=2)
    uncached = run_engine(tiny_llama_dir, records, batch_size=1, max_new_tokens=2, enable_prefix_caching=False)
    check_against_transformers(hf_model, by_id(cached)["scored"])
    assert by_id(cached)["scored"].prompt_logprobs == by_id(uncached)["scored"].prompt_logprobs
    assert cached.summary["prefix_cache_hit_tokens"] == 32  # `later`'s two blocks; `scored` took none


def test_the_kv_cache_manager_offers_no_prefix_hit_to_a_request_scoring_its_prompt():
    manager = KVCacheManager(8, 4, [attention_spec(1, 4, torch.float32)])
    done = make_request("done", prompt=range(3, 12))
    assert manager.allocate_slots(done, 9) is not None
    done.num_computed_tokens = 9
    manager.cache_computed_blocks(done)
    assert manager.find_prefix_hit(make_request("plain", prompt=range(3, 12))).num_tokens == 8
    assert manager.find_prefix_hit(make_request("scoring", prompt=range(3, 12), prompt_logprobs=0)).num_tokens == 0


def test_preemption_by_recompute_neither_duplicates_nor_loses_prompt_logprobs(tiny_llama_dir, hf_model):
    """A pool of 6 usable blocks of 16 for prompts that grow past it in decode: requests are
    preempted and recompute their prompts (in chunks of 16), whose tokens are scored once each."""
    records = [scored(f"p{i}", random_prompt(n, seed=20 + i)) for i, n in enumerate([30, 25, 20])]
    result = run_engine(
        tiny_llama_dir, records, batch_size=3, num_blocks=7, max_model_len=96, max_new_tokens=24, max_prefill_tokens=16
    )
    assert result.summary["preemptions"] > 0
    for request in result.requests:
        check_against_transformers(hf_model, request)


def test_a_request_preempted_between_prompt_chunks_keeps_its_scored_tokens_and_scores_the_rest(
    tiny_llama_dir, hf_model
):
    inference = make_inference(tiny_llama_dir, max_prefill_tokens=16, max_new_tokens=2)
    core, request = inference.core, make_request("r", prompt=random_prompt(40, seed=25), prompt_logprobs=2)
    core.add_request(request)
    core.step()
    assert len(request.prompt_logprobs) == 16  # positions 0..15 scored tokens 1..16
    core.scheduler._preempt(request)  # as a full pool would
    while core.has_work():
        core.step()
    check_against_transformers(hf_model, request, num_top=2)


def test_requests_without_prompt_logprobs_get_no_extra_logits_rows_and_the_same_outputs(tiny_llama_dir, monkeypatch):
    inference = make_inference(tiny_llama_dir, batch_size=2)
    engine = inference.engine
    rows_computed: list[int] = []
    compute_logits = engine.worker.model.compute_logits

    def counting(hidden_states: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
        rows_computed.append(len(row_indices))
        return compute_logits(hidden_states, row_indices)

    monkeypatch.setattr(engine.worker.model, "compute_logits", counting)

    def prefill(*requests: Request):
        for request in requests:
            assert engine.kv_cache_manager.allocate_slots(request, request.num_prompt_tokens) is not None
        try:
            return engine.runner.execute(
                engine.kv_cache_manager.batch(list(requests), [r.num_prompt_tokens for r in requests], is_prefill=True)
            )
        finally:
            for request in requests:
                engine.kv_cache_manager.free(request)

    plain = dict(prompt=random_prompt(9, seed=30), logprobs=2)
    alone = prefill(make_request("plain", **plain))
    together = prefill(
        make_request("scoring", prompt=random_prompt(12, seed=31), prompt_logprobs=1), make_request("plain", **plain)
    )
    assert alone.prompt_logprobs is None
    assert rows_computed == [1, 1 + 1 + 11]  # alone: its sampled row; together: both sampled rows, 11 scored
    assert together.new_token_ids[1] == alone.new_token_ids[0]
    assert together.logprobs[1] == alone.logprobs[0]
    assert together.prompt_logprobs is not None
    assert [len(entries) for entries in together.prompt_logprobs] == [11, 0]


def test_a_recomputed_prompt_scores_only_the_tokens_not_yet_scored(tiny_llama_dir):
    engine = make_inference(tiny_llama_dir).engine
    request = make_request("r", prompt=random_prompt(10, seed=40), prompt_logprobs=0)
    request.prompt_logprobs = [TokenLogprobs(token, 0.0) for token in request.prompt_token_ids[1:5]]
    assert engine.kv_cache_manager.allocate_slots(request, 10) is not None
    (sequence,), layout = engine.runner.prepare_inputs(
        engine.kv_cache_manager.batch([request], [10], is_prefill=True), [[]]
    )
    assert sequence.prompt_logprob_rows == range(4, 9)  # positions 4..8 score tokens 5..9
    assert layout.prompt_logprob_indices == [4, 5, 6, 7, 8]


def test_outputs_jsonl_gives_null_for_the_first_prompt_token_then_each_token_with_its_top(tiny_llama_dir, tmp_path):
    records = [scored("scored", random_prompt(6, seed=50), num_top=2), PromptRecord("plain", prompt_token_ids=[5, 6])]
    run_engine(tiny_llama_dir, records, output_dir=tmp_path, batch_size=2, max_new_tokens=2)
    lines = {line["id"]: line for line in map(json.loads, (tmp_path / "outputs.jsonl").read_text().splitlines())}
    entries = lines["scored"]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 6
    assert [entry["token_id"] for entry in entries[1:]] == records[0].prompt_token_ids[1:]
    assert all(len(entry["top"]) == 2 and entry["logprob"] <= 0.0 for entry in entries[1:])
    assert lines["plain"]["prompt_logprobs"] is None
