"""MTP speculative decoding on a DeepSeek-V3-style model with one MTP module (random weights):
greedy output identical to greedy decoding without speculation, with one and with two drafts per
step (the second reuses the single module), through prefill chunks and a batch that shrinks."""

from __future__ import annotations

import pytest

from executor.core.engine import ExecutionEngine
from executor.core.kv_cache import KVCacheManager
from executor.core.spec_decode.mtp import MTPProposer
from executor.core.spec_decode.ngram import PromptLookup
from executor.core.spec_decode.proposer import drafting_proposer
from ops import torch_ref
from tests.deepseek_v3_harness import save_checkpoint
from tests.engine_harness import make_inference, token_records
from tests.factories import deepseek_config, tiny_tokenizer
from tests.paged_harness import random_prompts


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    config = deepseek_config(
        num_nextn_predict_layers=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    path = tmp_path_factory.mktemp("tiny_deepseek_v3_mtp")
    save_checkpoint(path, config)
    tiny_tokenizer().save_pretrained(path)
    return path


def greedy(
    path, next_n: int, speculative_config: dict | None = None, batch_size: int = 4
) -> tuple[list[list[int]], dict, ExecutionEngine]:
    records = token_records(random_prompts([1, 5, 17, 33, 8, 40, 3], seed=5))
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 6 + 4 * index
    inference = make_inference(
        path,
        model_config={"model_name": "deepseek_v3", "next_n": next_n},
        batch_size=batch_size,
        max_prefill_tokens=24,  # prompts of 33 and 40 tokens are prefilled in chunks
        max_new_tokens=40,
        speculative_config=speculative_config,
    )
    result = inference.generate(records)
    return [r.output_token_ids for r in result.requests], result.summary, inference.engine


@pytest.mark.parametrize("next_n", [1, 2])
def test_mtp_speculation_on_deepseek_gives_greedy_output(deepseek_dir, next_n):
    expected, _, _ = greedy(deepseek_dir, 0)
    outputs, summary, engine = greedy(deepseek_dir, next_n)
    assert outputs == expected
    assert summary["speculative"]["draft_tokens"] > 0
    # the greedy choice of the target's rows and of the drafts: the backend's (the CPU kernel here)
    proposer = drafting_proposer(engine.runner.proposer)
    assert (
        engine.sampler.argmax_rows is engine.backend.argmax_rows and proposer.argmax_rows is engine.backend.argmax_rows
    )
    assert engine.backend.argmax_rows != torch_ref.argmax_rows


def test_mtp_drafts_write_into_lookahead_slots_the_scheduler_allocated(deepseek_dir, monkeypatch):
    """The MTP proposer allocates nothing in the target's KV cache: its drafts after the first go
    into the num_lookahead_tokens (k - 1) slots the scheduler allocates with each step."""
    calls: list[tuple[bool, int]] = []  # (during a proposal, num_lookahead_tokens) per allocate_slots
    proposing = [False]
    allocate_slots, propose = KVCacheManager.allocate_slots, MTPProposer.propose

    def recording_allocate(self, request, num_new_tokens, num_lookahead_tokens=0):
        calls.append((proposing[0], num_lookahead_tokens))
        return allocate_slots(self, request, num_new_tokens, num_lookahead_tokens)

    def recording_propose(self, context):
        proposing[0] = True
        try:
            return propose(self, context)
        finally:
            proposing[0] = False

    monkeypatch.setattr(KVCacheManager, "allocate_slots", recording_allocate)
    monkeypatch.setattr(MTPProposer, "propose", recording_propose)
    inference = make_inference(deepseek_dir, model_config={"model_name": "deepseek_v3", "next_n": 3}, max_new_tokens=8)
    assert inference.core.scheduler.num_lookahead_tokens == 2
    result = inference.generate(token_records(random_prompts([5, 9], seed=6)))
    assert result.summary["speculative"]["draft_tokens"] > 0
    assert not any(during for during, _ in calls)
    assert (False, 2) in calls


def test_mtp_writes_its_kv_for_prompt_chunks_that_sample_no_row(deepseek_dir, monkeypatch):
    """A prompt of 40 tokens in chunks of 16: the first two chunks sample no row, yet the MTP layer
    runs over their rows (inputs shifted by one), so its K/V covers every prompt position before the
    first draft reads it."""
    covered: list[int] = []
    run = MTPProposer._run

    def recording_run(self, layer, sequences, previous_hidden):
        for sequence in sequences:
            start = sequence.num_computed_tokens
            covered.extend(range(start, start + len(sequence.token_ids)))
        return run(self, layer, sequences, previous_hidden)

    monkeypatch.setattr(MTPProposer, "_run", recording_run)
    inference = make_inference(
        deepseek_dir, model_config={"model_name": "deepseek_v3", "next_n": 1}, max_prefill_tokens=16, max_new_tokens=2
    )
    inference.generate(token_records(random_prompts([40], seed=7)))
    assert set(range(40)) <= set(covered)


def test_prompt_lookup_in_front_of_mtp_gives_greedy_output_and_stops_the_chain_where_it_found_drafts(
    deepseek_dir, monkeypatch
):
    """speculative_config.prompt_lookup: requests whose last n-gram recurs take the lookup's drafts,
    the others the MTP chain; a proposal whose drafting requests all found one runs the first pass
    alone (it writes the MTP layer's K/V), and summary.json counts the looked-up verifies apart."""
    proposals: list[tuple[int, int, int]] = []  # (drafting requests, of them looked up, passes) per proposal
    run, lookups = MTPProposer._run, PromptLookup.lookups

    def recording_lookups(self, context, indices):
        found = lookups(self, context, indices)
        proposals.append((len(indices), len(found), 0))
        return found

    def recording_run(self, layer, sequences, previous_hidden):
        drafting, looked_up, passes = proposals[-1]
        proposals[-1] = (drafting, looked_up, passes + 1)
        return run(self, layer, sequences, previous_hidden)

    monkeypatch.setattr(MTPProposer, "_run", recording_run)
    monkeypatch.setattr(PromptLookup, "lookups", recording_lookups)
    expected, _, _ = greedy(deepseek_dir, 0)
    outputs, summary, _ = greedy(deepseek_dir, 2, {"prompt_lookup": True, "prompt_lookup_min": 1})
    assert outputs == expected
    alone, _, _ = greedy(deepseek_dir, 2, {"prompt_lookup": True, "prompt_lookup_min": 1}, batch_size=1)
    assert alone == expected
    looked_up = summary["speculative"]["looked_up"]
    assert summary["speculative"]["prompt_lookup"] is True
    assert looked_up["verifies"] > 0 and 0 < looked_up["share_of_verifies"] < 1
    assert 0 <= looked_up["accepted_tokens"] <= looked_up["draft_tokens"] <= 2 * looked_up["verifies"]
    all_looked_up = [passes for drafting, found, passes in proposals if drafting and found == drafting]
    some_chained = [passes for drafting, found, passes in proposals if found < drafting]
    assert all_looked_up and set(all_looked_up) == {1}
    assert some_chained and max(some_chained) == 2
