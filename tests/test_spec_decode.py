"""Speculative decoding: verification, rejection sampling, the n-gram and draft-model proposers, and
greedy output identical to greedy decoding without speculation."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.core.config import ConfigError, build_config
from executor.core.spec_decode.draft_model import DraftModelProposer
from executor.core.spec_decode.factory import draft_model_config
from executor.core.spec_decode.ngram import NgramProposer, PromptLookup, RequestLookups
from executor.core.spec_decode.proposer import ProposalContext
from executor.core.spec_decode.verify import accept_greedy, rejection_sample
from executor.offline.dataset import PromptRecord
from executor.offline.offline_inference import OfflineInference, RunResult
from executor.types_ import Batch, RequestStatus, StepResult
from tests.conftest import save_tiny_llama
from tests.engine_harness import token_records
from tests.factories import make_request
from tests.spec_decode_harness import ngram_accept_counts


def test_greedy_verification_keeps_the_matching_prefix_then_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all pass: the bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first mismatch ends the step
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


@pytest.mark.parametrize("deterministic_draft", [True, False])
def test_rejection_sampling_leaves_the_target_distribution_unchanged(deterministic_draft):
    """Over many verify steps, the first emitted token follows the target's row-0 distribution,
    whatever the drafts; total variation against it stays within sampling noise."""
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    draft_dist = torch.tensor([[0.1, 0.1, 0.7, 0.1], [0.4, 0.3, 0.2, 0.1]])
    counts = torch.zeros(4)
    num_samples = 20_000
    for _ in range(num_samples):
        if deterministic_draft:
            drafts, draft_probs = [2, 1], None  # an n-gram's guess: one-hot draft distribution
        else:
            drafts = [int(torch.multinomial(row, 1, generator=generator)) for row in draft_dist]
            draft_probs = draft_dist
        emitted = rejection_sample(target, drafts, draft_probs, generator)
        counts[emitted[0]] += 1
    total_variation = 0.5 * (counts / num_samples - target[0]).abs().sum()
    assert total_variation < 0.015, f"TV {total_variation:.4f}"


def test_rejection_sampling_accepts_a_draft_the_target_is_sure_of_and_adds_a_bonus():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(target, [1], None) == [1, 2]
    assert rejection_sample(target, [0], None) == [1]  # p(draft) = 0: rejected, resampled from p - q


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    assert ngram.propose_for([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]) == [5, 6, 1]  # latest "1 2 3"
    assert ngram.propose_for([7, 8, 9]) == []  # nothing recurs
    assert ngram.propose_for([4, 5, 6, 4]) == [5, 6, 4]  # a 1-gram when no longer one matches
    assert NgramProposer(2, 2, 3).propose_for([4, 5, 6, 4]) == []  # min_n 2: the 1-gram does not count


def windowed_lookup(ngram: NgramProposer, tokens: list[int]) -> list[int]:
    """The lookup as its definition reads: every earlier n-gram compared, longest n first, latest wins."""
    for n in range(min(ngram.max_n, len(tokens) - 1), ngram.min_n - 1, -1):
        matches = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if matches:
            return tokens[matches[-1] + n : matches[-1] + n + ngram.num_speculative_tokens]
    return []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    k=st.integers(1, 4),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_ngram_lookup_equals_comparing_every_earlier_ngram(tokens, k, min_n, extra):
    ngram = NgramProposer(num_speculative_tokens=k, min_n=min_n, max_n=min_n + extra)
    assert ngram.propose_for(tokens) == windowed_lookup(ngram, tokens)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=20),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 4), max_size=3), st.lists(st.integers(0, 4), max_size=3), st.booleans()),
        max_size=12,
    ),
    k=st.integers(1, 4),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_a_request_s_index_grows_with_it_and_looks_up_what_a_fresh_search_would(prompt, steps, k, min_n, extra):
    """Each step looks up after the request's tokens and the step's emitted ones; those become its
    output, or (a request cut short) others do, which the index notices. A finished one is let go."""
    ngram = NgramProposer(num_speculative_tokens=k, min_n=min_n, max_n=min_n + extra)
    lookups = RequestLookups(ngram)
    request = make_request("r", prompt=prompt)
    for new, other, kept in steps:
        tokens = request.prompt_token_ids + request.output_token_ids + new
        assert lookups.propose_after(request, new) == windowed_lookup(ngram, tokens)
        request.output_token_ids.extend(new if kept else other)
    request.status = RequestStatus.FINISHED
    lookups.forget_finished()
    assert not lookups._indexed  # a finished request's index is let go


def test_prompt_lookup_counts_the_verifies_of_the_drafts_it_gave_and_forgets_finished_requests():
    lookup = PromptLookup(NgramProposer(num_speculative_tokens=2, min_n=2, max_n=2))
    repeating = make_request("a", prompt=[1, 2, 3, 1, 2])
    fresh = make_request("b", prompt=[7, 8, 9])

    def context(new_tokens, verified=(), accepted=()) -> ProposalContext:
        return ProposalContext(
            [repeating, fresh], [], new_tokens, [0, 0], torch.empty(0), [0, 0], list(verified), list(accepted)
        )

    first = context([[3], [10]])
    assert lookup.lookups(first, [0, 1]) == {0: [1, 2]}  # "2 3" recurs in a's tokens: what followed it
    assert first.looked_up.verifies == 0
    # a's looked-up drafts verified (cut to one by the scheduler: a prefix), b's were a drafter's
    second = context([[1, 5], [11]], verified=[[1], [12, 13]], accepted=[1, 0])
    lookup.lookups(second, [0, 1])
    assert (second.looked_up.verifies, second.looked_up.num_drafted, second.looked_up.num_accepted) == (1, 1, 1)
    repeating.output_token_ids.extend([3, 1, 2])  # a's next lookup: the latest "2 3", then it finishes
    assert lookup.lookups(context([[3], []]), [0]) == {0: [1, 2]}
    repeating.status = RequestStatus.FINISHED
    lookup.lookups(context([[], []]), [])
    assert "a" not in lookup._given


def test_speculative_config_rules():
    assert build_config({"model_config": {"next_n": 2}}).speculation == ("mtp", 2)
    assert build_config({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}).speculation == (
        "ngram",
        3,
    )
    with pytest.raises(ConfigError, match="num_speculative_tokens in t.yaml must be >= 1"):
        build_config({"speculative_config": {"method": "ngram"}}, source="t.yaml")
    with pytest.raises(ConfigError, match="draft_model_path in t.yaml is required"):
        build_config({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, source="t.yaml")
    with pytest.raises(ConfigError, match="next_n 1 means speculative_config.method mtp"):
        build_config({"model_config": {"next_n": 1}, "speculative_config": {"method": "ngram"}}, source="t.yaml")
    lookup = {"num_speculative_tokens": 2, "draft_model_path": "d", "prompt_lookup": True}
    assert build_config({"speculative_config": lookup | {"method": "eagle3"}}).speculative_config.prompt_lookup
    assert build_config({"model_config": {"next_n": 2}, "speculative_config": {"prompt_lookup": True}})
    with pytest.raises(ConfigError, match="prompt_lookup in t.yaml .* method 'draft_model' has none"):
        build_config({"speculative_config": lookup | {"method": "draft_model"}}, source="t.yaml")
    with pytest.raises(ConfigError, match="prompt_lookup in t.yaml .* method 'off' has none"):
        build_config({"speculative_config": {"prompt_lookup": True}}, source="t.yaml")


def repetitive_records(count: int = 6, seed: int = 0) -> list[PromptRecord]:
    """Prompts that repeat a phrase (n-grams recur), each request stopping at its own step."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, 250) for _ in range(9)]
    records = token_records([phrase * 3 + [rng.randrange(3, 250) for _ in range(i)] for i in range(count)])
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 8 + 3 * index
    return records


def run(model_dir: Path, records: list[PromptRecord], **speculative) -> RunResult:
    config = build_config(
        {
            "model_config": {"model_path": str(model_dir), "dtype": "float32", "device": "cpu"},
            "data_config": {"apply_chat_template": False},
            "scheduler_config": {"block_size": 4, "batch_size": 4, "num_blocks": 160, "max_model_len": 96},
            "speculative_config": speculative,
        },
        source="test.yaml",
    )
    return OfflineInference(config, str(model_dir)).generate(records)


def outputs(result: RunResult) -> list[list[int]]:
    return [request.output_token_ids for request in result.requests]


@pytest.fixture(scope="module")
def greedy(tiny_llama_dir) -> list[list[int]]:
    return outputs(run(tiny_llama_dir, repetitive_records()))


def test_ngram_speculation_gives_greedy_output_and_counts_each_draft_position(tiny_llama_dir, greedy):
    """The accept counts, per draft position, are those the greedy outputs imply (spec_decode_harness)."""
    records = repetitive_records()
    result = run(tiny_llama_dir, records, method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    assert outputs(result) == greedy
    assert [len(output) for output in greedy] == [r.sampling_overrides["max_new_tokens"] for r in records]  # no EOS
    stats = result.summary["speculative"]
    ngram = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=4)
    expected = ngram_accept_counts(zip([r.prompt_token_ids for r in records], greedy, strict=True), ngram, 96)
    assert stats["per_position"] == expected.per_position()
    assert len(stats["per_position"]) == 3 and 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    assert (stats["draft_tokens"], stats["accepted_tokens"]) == (expected.num_drafted, expected.num_accepted)
    assert stats["mean_accept_length"] == 1 + stats["accepted_tokens"] / sum(
        s.num_verified_requests for s in result.steps
    )


@pytest.fixture(scope="module")
def other_tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("other_tiny_llama"), seed=1)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_speculation_gives_greedy_output(draft, tiny_llama_dir, other_tiny_llama_dir, greedy):
    """The target as its own draft accepts every draft; another random model few: both are exact."""
    draft_dir = tiny_llama_dir if draft == "same" else other_tiny_llama_dir
    result = run(
        tiny_llama_dir,
        repetitive_records(),
        method="draft_model",
        num_speculative_tokens=3,
        draft_model_path=str(draft_dir),
    )
    assert outputs(result) == greedy
    stats = result.summary["speculative"]
    if draft == "same":
        assert stats["accept_rate"] == 1.0 and stats["mean_accept_length"] > 3
    else:
        assert stats["accept_rate"] < 0.5


def test_speculative_config_quantization_quantizes_the_draft_model_alone(tiny_llama_dir, greedy):
    """The target as its own draft accepts every draft (above); rounded to 4 bits at load by
    speculative_config.quantization, it drafts some tokens the target does not emit, and the
    output stays the target's. Without the key the draft takes model_config.quantization."""
    result = run(
        tiny_llama_dir,
        repetitive_records(),
        method="draft_model",
        num_speculative_tokens=3,
        draft_model_path=str(tiny_llama_dir),
        quantization="w4a16_g16",
    )
    assert outputs(result) == greedy
    assert result.summary["speculative"]["quantization"] == "w4a16_g16"
    assert 0 < result.summary["speculative"]["accept_rate"] < 1
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "draft_model_path": "d"}
    config = build_config({"model_config": {"quantization": "w8a8"}, "speculative_config": spec})
    assert draft_model_config(config).model_config.quantization == "w8a8"
    config = build_config(
        {"model_config": {"quantization": "w8a8"}, "speculative_config": spec | {"quantization": "w8a16"}}
    )
    assert draft_model_config(config).model_config.quantization == "w8a16"
    assert draft_model_config(config).speculative_config.quantization == ""


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(tiny_llama_dir, greedy):
    records = repetitive_records()
    stop_token = greedy[3][4]  # a token the target emits inside a step whose drafts all pass
    records[3].sampling_overrides["stop_token_ids"] = [stop_token]
    expected = outputs(run(tiny_llama_dir, records))
    assert expected[3] == greedy[3][: greedy[3].index(stop_token) + 1]
    result = run(
        tiny_llama_dir, records, method="draft_model", num_speculative_tokens=3, draft_model_path=str(tiny_llama_dir)
    )
    assert outputs(result) == expected


def test_random_requests_under_speculation_are_reproducible_and_use_rejection_sampling(tiny_llama_dir):
    """A seeded random request verifies drafts by rejection sampling: two runs give the same
    outputs, and the target's own greedy drafts are accepted at a rate below 1 (a greedy request
    accepts every one of them), since each passes only with its probability under the target."""
    records = repetitive_records()
    for record in records:
        record.sampling_overrides |= {"temperature": 0.8, "seed": 7}
    first = run(
        tiny_llama_dir, records, method="draft_model", num_speculative_tokens=3, draft_model_path=str(tiny_llama_dir)
    )
    second = run(
        tiny_llama_dir, records, method="draft_model", num_speculative_tokens=3, draft_model_path=str(tiny_llama_dir)
    )
    assert outputs(first) == outputs(second)
    assert all(len(out) == 8 + 3 * index for index, out in enumerate(outputs(first)))  # EOS never drawn here
    stats = first.summary["speculative"]
    assert stats["draft_tokens"] > 0 and stats["accept_rate"] < 1


class CountingDraftRunner:
    """A draft model that always predicts its last fed token + 1, recording what each step fed."""

    def __init__(self) -> None:
        self.fed: list[list[tuple[int, int]]] = []  # per step: (computed tokens, fed count) per request

    def execute(self, batch: Batch) -> StepResult:
        scheduled = zip(batch.requests, batch.num_scheduled_tokens, strict=True)
        self.fed.append([(request.num_computed_tokens, num_tokens) for request, num_tokens in scheduled])
        new = [[r.token_ids_between(r.num_tokens - 1, r.num_tokens)[0] + 1] for r in batch.requests]
        return StepResult(new, [0] * len(new), [[] for _ in new])


class AlwaysRoomKV:
    def allocate_slots(self, request, num_new_tokens, num_lookahead_tokens=0):
        return [[1]]

    def batch(self, requests, num_scheduled_tokens, *, is_prefill, draft_token_ids=None):
        return Batch(requests, num_scheduled_tokens, is_prefill, draft_token_ids or [], [[[1]] for _ in requests])

    def free(self, request) -> None:
        pass


def test_the_draft_model_proposer_changes_no_request_and_rolls_back_to_the_agreed_prefix():
    runner = CountingDraftRunner()
    proposer = DraftModelProposer(runner, AlwaysRoomKV(), num_speculative_tokens=2)
    request = make_request("r", prompt=[10, 11, 12])

    def context(new_tokens: list[int]) -> ProposalContext:
        return ProposalContext([request], [], [new_tokens], [0], torch.empty(0), [0])

    before = copy.deepcopy(request)
    assert proposer.propose(context([13])) == [[14, 15]]  # fed the prompt and 13, then 14
    assert runner.fed == [[(0, 4)], [(4, 1)]]
    assert request == before  # only the scheduler changes a Request
    request.output_token_ids.extend([13, 14, 20])  # as the scheduler would: draft 15 rejected for 20
    assert proposer.propose(context([21])) == [[22, 23]]
    # the mirror kept 10..14 (5 computed) and is fed 20 and 21 from there
    assert runner.fed[2:] == [[(5, 2)], [(7, 1)]]
