"""The sampler: each stage against transformers' logits processors or a direct computation, the
stages in order, greedy and random rows in one batch, seeds that ignore the batch, logprobs, and
random rows that follow the processed distribution; then end to end through the offline runner."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from executor.core.config import ConfigError, build_config
from executor.core.sampler import Sampler, SamplingMetadata, request_seed
from executor.core.sampler.sampler import NAN_LOGITS_TOKEN
from executor.offline.dataset import PromptRecord
from executor.types_ import Request, SamplingParams
from ops import cpu_kernels, torch_ref
from tests.engine_harness import hf_greedy, hf_last_logits, load_hf_model, run_engine
from tests.factories import make_request
from tests.run_harness import outputs_by_id, run_into, write_run

VOCAB = 40
EXAMPLES = settings(max_examples=40, deadline=None)


def make_logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def processed(requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
    return Sampler(0, "cpu", torch_ref.argmax_rows).processed_logits(logits, SamplingMetadata.build(requests, "cpu"))


def sample(requests: list[Request], logits: torch.Tensor, run_seed: int = 0):
    metadata = SamplingMetadata.build(requests, "cpu")
    return Sampler(run_seed, "cpu", torch_ref.argmax_rows).sample(logits, metadata), metadata


def hf_process(request: Request, row: torch.Tensor, processors: list) -> torch.Tensor:
    """transformers' processors over one row, with the request's prompt + output as input_ids."""
    input_ids = torch.tensor([request.prompt_token_ids + request.output_token_ids])
    return LogitsProcessorList(processors)(input_ids, row[None].clone())[0]


def assert_same_logits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal cuts (-inf in the same places) and equal values elsewhere."""
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    torch.testing.assert_close(ours[kept], expected[kept], rtol=1e-6, atol=1e-5)


# -- each stage against a reference ---------------------------------------------------------


@EXAMPLES
@given(
    seed=st.integers(0, 10**6), top_ks=st.lists(st.integers(0, VOCAB + 5), min_size=1, max_size=5), sort=st.booleans()
)
def test_top_k_keeps_the_k_largest_logits_as_transformers_does(seed, top_ks, sort):
    """Both paths: top-k alone (topk, no sort) and beside a top-p row (one sort for both)."""
    requests = [make_request(f"r{i}", temperature=1.0, top_k=k) for i, k in enumerate(top_ks)]
    if sort:
        requests.append(make_request("p", temperature=1.0, top_p=0.5))
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, k in enumerate(top_ks):
        expected = hf_process(requests[row], logits[row], [TopKLogitsWarper(k)] if k else [])
        assert_same_logits(ours[row], expected)


def naive_top_p_keep(logits: np.ndarray, top_p: float) -> np.ndarray:
    """The tokens that a nucleus of probability top_p keeps: most likely first, each kept while the
    tokens before it hold less than top_p."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = np.zeros_like(probs, dtype=bool)
    before = 0.0
    for token in np.argsort(-probs, kind="stable"):
        if before >= top_p:
            break
        keep[token] = True
        before += probs[token]
    return keep


# Up to 0.999: past it the nucleus ends among tokens whose probabilities lie below float32's resolution
# of a cumulative sum near 1 (6e-8), where the sampler's float32 sum and the naive float64 one may part
# by a token (top_p 0.99999 did); top_p 1.0, no filter at all, is the same in both.
TOP_PS = st.one_of(st.floats(0.05, 0.999), st.just(1.0))


@EXAMPLES
@given(seed=st.integers(0, 10**6), top_ps=st.lists(TOP_PS, min_size=1, max_size=5))
def test_top_p_keeps_the_smallest_nucleus_as_a_naive_sort_and_transformers_do(seed, top_ps):
    requests = [make_request(f"r{i}", temperature=1.0, top_p=p) for i, p in enumerate(top_ps)]
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, p in enumerate(top_ps):
        assert np.array_equal(~torch.isinf(ours[row]).numpy(), naive_top_p_keep(logits[row].double().numpy(), p))
        assert_same_logits(ours[row], hf_process(requests[row], logits[row], [TopPLogitsWarper(p)]))


@EXAMPLES
@given(seed=st.integers(0, 10**6), min_ps=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5))
def test_min_p_cuts_tokens_below_its_share_of_the_top_probability_as_transformers_does(seed, min_ps):
    requests = [make_request(f"r{i}", temperature=1.0, min_p=p) for i, p in enumerate(min_ps)]
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, p in enumerate(min_ps):
        assert_same_logits(ours[row], hf_process(requests[row], logits[row], [MinPLogitsWarper(p)] if p else []))


@EXAMPLES
@given(seed=st.integers(0, 10**6), temperatures=st.lists(st.floats(0.05, 5.0), min_size=1, max_size=5))
def test_temperature_divides_the_logits_as_transformers_does(seed, temperatures):
    requests = [make_request(f"r{i}", temperature=t) for i, t in enumerate(temperatures)]
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, t in enumerate(temperatures):
        assert_same_logits(ours[row], hf_process(requests[row], logits[row], [TemperatureLogitsWarper(t)]))


token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@EXAMPLES
@given(
    seed=st.integers(0, 10**6),
    rows=st.lists(st.tuples(token_lists, token_lists, st.floats(0.5, 2.0), st.booleans()), min_size=1, max_size=4),
)
def test_repetition_penalty_covers_prompt_and_output_as_transformers_does(seed, rows):
    """Greedy rows are penalised too (their argmax moves); prompts here may repeat tokens."""
    requests = [
        make_request(
            f"r{i}", prompt=[7, *prompt], output=output, repetition_penalty=penalty, temperature=0.0 if g else 1
        )
        for i, (prompt, output, penalty, g) in enumerate(rows)
    ]
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, request in enumerate(requests):
        penalty = request.sampling_params.repetition_penalty
        assert_same_logits(ours[row], hf_process(request, logits[row], [RepetitionPenaltyLogitsProcessor(penalty)]))


@EXAMPLES
@given(
    seed=st.integers(0, 10**6),
    rows=st.lists(
        st.tuples(token_lists, token_lists, st.floats(-2.0, 2.0), st.floats(-2.0, 2.0)), min_size=1, max_size=4
    ),
)
def test_frequency_and_presence_penalties_count_output_tokens_only(seed, rows):
    requests = [
        make_request(
            f"r{i}", prompt=[7, *prompt], output=output, frequency_penalty=f, presence_penalty=p, temperature=1
        )
        for i, (prompt, output, f, p) in enumerate(rows)
    ]
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, (_, output, frequency, presence) in enumerate(rows):
        expected = logits[row].clone()
        for token in set(output):
            expected[token] -= frequency * output.count(token) + presence
        torch.testing.assert_close(ours[row], expected, rtol=1e-6, atol=1e-5)


@EXAMPLES
@given(
    seed=st.integers(0, 10**6),
    params=st.lists(
        st.fixed_dictionaries(
            {
                "repetition_penalty": st.floats(0.5, 2.0),
                "temperature": st.floats(0.1, 3.0),
                "top_k": st.integers(0, VOCAB),
                "top_p": st.floats(0.1, 1.0),
                "min_p": st.floats(0.0, 0.5),
            }
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_the_stages_run_in_transformers_order_with_each_row_its_own_parameters(seed, params):
    """Repetition penalty, temperature, top-k, top-p, min-p: transformers' warpers in generate()'s order."""
    requests = [make_request(f"r{i}", prompt=[3, 5, 5, 9], output=[9, 11], **p) for i, p in enumerate(params)]
    logits = make_logits(len(requests), seed)
    ours = processed(requests, logits)
    for row, p in enumerate(params):
        chain = [RepetitionPenaltyLogitsProcessor(p["repetition_penalty"]), TemperatureLogitsWarper(p["temperature"])]
        chain += [TopKLogitsWarper(p["top_k"])] if p["top_k"] else []
        chain += [TopPLogitsWarper(p["top_p"])] if p["top_p"] < 1.0 else []
        chain += [MinPLogitsWarper(p["min_p"])] if p["min_p"] else []
        assert_same_logits(ours[row], hf_process(requests[row], logits[row], chain))


# -- greedy and random rows -----------------------------------------------------------------


def kernel_argmax(allow_avx512: bool):
    kernels = cpu_kernels.extension()
    assert kernels is not None, "the CPU kernels build where a compiler is present"
    return lambda scores: kernels.argmax_rows(scores, allow_avx512)


# The greedy choice's forms: the reference (max(dim=-1)) and the CPU kernel's two paths (AVX-512 where the
# CPU has it, the eight-float vectors on any CPU).
ARGMAX_FORMS = {
    "reference": lambda: torch_ref.argmax_rows,
    "kernel_avx512": lambda: kernel_argmax(True),
    "kernel_vectors": lambda: kernel_argmax(False),
}


@pytest.mark.parametrize("form", ARGMAX_FORMS)
@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([-1.0, 0.0, -0.0, 2.0, 2.0, 2.0, float("inf"), float("-inf"), float("nan")]),
        min_size=1,
        max_size=150,
    ),
    rows=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    data=st.data(),
)
def test_argmax_rows_picks_the_index_argmax_picks_ties_infinities_and_nan_included(form, values, rows, dtype, data):
    """The greedy choice goes through max(dim=-1), or the CPU kernel's vectors, for speed; it must pick
    argmax's index everywhere: the first of tied maxima, NaN above all, at every row length (the
    kernel's vectors of 64, 16 and 8 and their tails)."""
    scores = torch.tensor(values, dtype=dtype).repeat(rows, 1)
    for row in range(1, rows):  # rows that differ
        scores[row, data.draw(st.integers(0, len(values) - 1))] = data.draw(st.sampled_from([3.0, float("nan")]))
    assert torch.equal(ARGMAX_FORMS[form]()(scores), scores.argmax(dim=-1))


@pytest.mark.parametrize("form", ARGMAX_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_over_a_vocabulary_of_logits(form, dtype):
    """Logits as a verify step has them: 32 rows over a vocabulary that is no multiple of the vectors."""
    scores = torch.randn(32, 49_157).to(dtype)
    assert torch.equal(ARGMAX_FORMS[form]()(scores), scores.argmax(dim=-1))


def test_an_all_greedy_batch_is_one_argmax_over_the_raw_logits(monkeypatch):
    logits = make_logits(5, seed=1).to(torch.bfloat16)
    requests = [make_request(f"r{i}", top_k=3, top_p=0.5) for i in range(5)]  # filters do not move an argmax
    metadata = SamplingMetadata.build(requests, "cpu")
    assert not metadata.needs_processing and metadata.temperature is None and metadata.top_k is None
    sampler = Sampler(0, "cpu", torch_ref.argmax_rows)
    monkeypatch.setattr(sampler, "processed_logits", lambda *args: pytest.fail("a greedy step processed its logits"))
    output = sampler.sample(logits, metadata)
    assert torch.equal(output.token_ids, logits.argmax(dim=-1)) and output.logprobs is None


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 3, "logprobs": 2}], ids=["greedy", "random"])
def test_a_row_whose_logits_hold_nan_samples_the_nan_mark_and_the_others_sample_as_before(params):
    logits = make_logits(3, seed=4)
    clean, _ = sample([make_request(f"r{i}", **params) for i in range(3)], logits)
    logits[1, 7] = float("nan")
    output, _ = sample([make_request(f"r{i}", **params) for i in range(3)], logits)
    assert output.token_ids.tolist() == [clean.token_ids[0], NAN_LOGITS_TOKEN, clean.token_ids[2]]


def test_greedy_and_random_rows_mix_in_one_batch_each_as_if_alone():
    logits = make_logits(6, seed=2)
    requests = [
        make_request("greedy", output=[4]),
        make_request("hot", temperature=1.5, top_k=5, seed=11),
        make_request("penalised", output=[int(logits[2].argmax())], repetition_penalty=50.0),
        make_request("nucleus", temperature=0.7, top_p=0.6, seed=12),
        make_request("unseeded", temperature=1.0, min_p=0.2),
        make_request("cold", temperature=1e-6),  # below 1e-5: greedy
    ]
    output, metadata = sample(requests, logits)
    tokens = output.token_ids.tolist()
    assert metadata.greedy.tolist() == [True, False, True, False, False, True]
    assert tokens[0] == logits[0].argmax() and tokens[5] == logits[5].argmax()
    assert tokens[2] != logits[2].argmax()  # the penalty moved the argmax off the repeated token
    assert tokens[2] == processed(requests[2:3], logits[2:3])[0].argmax()
    kept = ~torch.isinf(processed(requests, logits))
    assert all(kept[row, tokens[row]] for row in (1, 3, 4))
    for row in (0, 1, 2, 3, 5):  # every row but the unseeded one gives the same token alone
        alone, _ = sample(requests[row : row + 1], logits[row : row + 1])
        assert alone.token_ids.item() == tokens[row]


@EXAMPLES
@given(
    seed=st.integers(0, 10**6),
    others=st.lists(st.sampled_from(["greedy", "seeded", "unseeded", "penalised"]), max_size=6),
    place=st.integers(0, 6),
    run_seed=st.integers(0, 100),
)
def test_a_seeded_request_samples_the_same_token_alone_or_in_any_batch(seed, others, place, run_seed):
    target = make_request("target", output=[5, 6], temperature=1.0, top_p=0.95, seed=1234)
    row_of_target = min(place, len(others))
    kinds = {
        "greedy": {},
        "seeded": {"temperature": 0.8, "seed": 7},
        "unseeded": {"temperature": 1.2, "top_k": 4},
        "penalised": {"temperature": 1.0, "presence_penalty": 1.0, "seed": 8},
    }
    requests = [make_request(f"o{i}", output=[1], **kinds[kind]) for i, kind in enumerate(others)]
    requests.insert(row_of_target, target)
    logits = make_logits(len(requests), seed)
    target_logits = make_logits(1, seed=99)
    logits[row_of_target] = target_logits[0]
    in_batch, _ = sample(requests, logits, run_seed)
    alone, _ = sample([target], target_logits, run_seed=run_seed + 1)
    assert in_batch.token_ids[row_of_target] == alone.token_ids[0]


def test_a_seeded_request_draws_new_noise_at_each_output_index_and_for_each_seed():
    logits = torch.zeros(1, VOCAB)  # uniform: the token is the noise's choice alone

    def token(request: Request) -> int:
        return sample([request], logits)[0].token_ids.item()

    by_index = {token(make_request(output=[0] * n, temperature=1.0, seed=3)) for n in range(30)}
    by_seed = {token(make_request(temperature=1.0, seed=s)) for s in range(30)}
    assert len(by_index) > 10 and len(by_seed) > 10


def test_unseeded_rows_follow_the_run_seed():
    logits = torch.zeros(64, VOCAB)
    requests = [make_request(f"r{i}", temperature=1.0) for i in range(64)]
    first, second, other = (sample(requests, logits, run_seed)[0].token_ids for run_seed in (5, 5, 6))
    assert torch.equal(first, second) and not torch.equal(first, other)


def test_request_seeds_differ_by_request_and_run_and_stay_below_two_to_the_63():
    seeds = {request_seed(run, f"r{i}") for run in range(3) for i in range(100)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(1, "r1") == request_seed(1, "r1")


def test_a_request_owning_several_rows_samples_each_at_its_own_output_index():
    """A verify step's k+1 rows of one request: row j samples what the request alone would sample
    after j more tokens, given the same logits; penalties count the tokens before the step."""
    logits = make_logits(3, seed=4)
    request = make_request(output=[8, 9], temperature=1.0, top_k=10, seed=21, frequency_penalty=0.5)
    output, metadata = sample([request] * 3, logits)
    assert metadata.random_positions == [2, 3, 4]
    penalised = processed([make_request(output=[8, 9], frequency_penalty=0.5)] * 3, logits)  # greedy: penalty only
    for j in range(3):
        later = make_request(output=[8, 9] + [0] * j, temperature=1.0, top_k=10, seed=21)
        alone, _ = sample([later], penalised[j : j + 1])
        assert alone.token_ids.item() == output.token_ids[j].item()


# -- the distribution random rows follow ----------------------------------------------------


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(tokens, minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * (empirical - probs.double()).abs().sum().item()


@pytest.mark.parametrize("seeded", [False, True], ids=["run generator", "per-request seeds"])
def test_random_rows_sample_the_processed_distribution(seeded):
    """10,000 draws (unseeded rows of one step, or as many requests with seeds of their own) are
    within 0.02 in total variation of `probabilities` (sampling error alone gives about 0.008),
    while the unfiltered softmax is 0.12 away: a sampler that ignored the filters would fail."""
    num_samples = 10_000
    row = make_logits(1, seed=5, scale=1.5)
    params = {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "min_p": 0.05}
    requests = [
        make_request(f"r{i}", seed=request_seed(0, f"r{i}") if seeded else None, **params) for i in range(num_samples)
    ]
    sampler = Sampler(0, "cpu", torch_ref.argmax_rows)
    probs = sampler.probabilities(row, SamplingMetadata.build(requests[:1], "cpu"))[0]
    tokens = sampler.sample(row.expand(num_samples, VOCAB), SamplingMetadata.build(requests, "cpu")).token_ids
    assert int((probs > 0).sum()) == 5  # the filters leave 5 of 40 tokens
    assert total_variation(tokens, probs) < 0.02
    assert total_variation(tokens, (row[0] / 0.8).softmax(dim=-1)) > 0.1


def test_probabilities_are_distributions_and_a_point_mass_on_greedy_rows():
    logits = make_logits(3, seed=6)
    requests = [
        make_request("g"),
        make_request("t", temperature=0.9, top_k=6),
        make_request("p", temperature=2, top_p=0.3),
    ]
    metadata = SamplingMetadata.build(requests, "cpu")
    probs = Sampler(0, "cpu", torch_ref.argmax_rows).probabilities(logits, metadata)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))
    assert probs[0, logits[0].argmax()] == 1.0 and (probs[0] > 0).sum() == 1
    assert (probs[1] > 0).sum() == 6
    assert torch.equal(probs[1:] == 0, torch.isinf(processed(requests, logits)[1:]))


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_those_of_the_processed_distribution_most_likely_first():
    logits = make_logits(4, seed=7)
    requests = [
        make_request("none", temperature=1.0, seed=1),
        make_request("sampled", temperature=0.7, top_k=8, seed=2, logprobs=0),
        make_request("top5", temperature=1.3, top_p=0.8, seed=3, logprobs=5),
        make_request("greedy", logprobs=3),
    ]
    output, metadata = sample(requests, logits)
    tokens = output.token_ids.tolist()
    none, sampled, top5, greedy = output.logprobs.per_row(tokens, metadata.num_logprobs)
    log_probs = Sampler(0, "cpu", torch_ref.argmax_rows).probabilities(logits, metadata).log()
    assert none is None
    assert sampled.token_id == tokens[1] and sampled.top_token_ids == [] and sampled.top_logprobs == []
    assert math.isclose(sampled.logprob, log_probs[1, tokens[1]].item(), abs_tol=1e-5)
    assert math.isclose(top5.logprob, log_probs[2, tokens[2]].item(), abs_tol=1e-5)
    assert top5.top_logprobs == sorted(top5.top_logprobs, reverse=True)
    assert top5.top_token_ids == log_probs[2].topk(len(top5.top_token_ids)).indices.tolist()
    assert 1 <= len(top5.top_token_ids) <= 5
    assert sum(math.exp(lp) for lp in top5.top_logprobs) <= 1 + 1e-6
    # greedy: the raw distribution (temperature 1, no cut), whose most likely token it sampled
    raw = logits[3].log_softmax(dim=-1)
    assert greedy.token_id == greedy.top_token_ids[0] == raw.argmax().item()
    torch.testing.assert_close(torch.tensor(greedy.top_logprobs), raw.topk(3).values)


def test_top_logprobs_leave_out_tokens_the_filters_cut():
    logits = make_logits(1, seed=8)
    output, metadata = sample([make_request(temperature=1.0, top_k=2, seed=1, logprobs=6)], logits)
    (entry,) = output.logprobs.per_row(output.token_ids.tolist(), metadata.num_logprobs)
    assert len(entry.top_token_ids) == 2 and all(math.isfinite(lp) for lp in entry.top_logprobs)
    assert math.isclose(sum(math.exp(lp) for lp in entry.top_logprobs), 1.0, rel_tol=1e-5)


# -- parameters: config and per-request checks agree ----------------------------------------

RANGES = {
    "temperature": st.floats(allow_nan=True, allow_infinity=True),
    "top_p": st.floats(-1, 2) | st.sampled_from([0.0, 1.0, float("inf")]),
    "min_p": st.floats(-1, 2) | st.sampled_from([0.0, 1.0]),
    "repetition_penalty": st.floats(-1, 3) | st.sampled_from([0.0, float("inf")]),
    "frequency_penalty": st.floats(-3, 3) | st.sampled_from([-2.0, 2.0]),
    "presence_penalty": st.floats(-3, 3) | st.sampled_from([-2.0, 2.0]),
    "top_k": st.integers(-3, 10**6),
    "seed": st.integers(-3, 2**64) | st.sampled_from([2**63 - 1, 2**63]),
    "logprobs": st.integers(-3, 30) | st.sampled_from([0, 20, 21]),
    "prompt_logprobs": st.integers(-3, 30) | st.sampled_from([0, 20, 21]),
}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), key=st.sampled_from(sorted(RANGES)))
def test_a_sampling_value_is_accepted_in_the_yaml_exactly_when_a_dataset_line_may_use_it(data, key):
    value = data.draw(RANGES[key])
    try:
        build_config({"data_config": {key: value}})
        config_accepts = True
    except ConfigError:
        config_accepts = False
    assert config_accepts == (SamplingParams(**{key: value}).check() is None), (key, value)


# -- end to end -----------------------------------------------------------------------------


def test_a_sampling_run_repeats_itself_and_does_not_depend_on_batch_size(tmp_path, tiny_llama_dir):
    run_yaml = write_run(tmp_path, tiny_llama_dir, num_prompts=6, seed=3)
    hot = ("data_config.temperature=1.0", "data_config.top_k=50")
    runs = {
        "first": (*hot,),
        "again": (*hot,),
        "one_at_a_time": (*hot, "scheduler_config.batch_size=1"),
        "other_seed": (*hot, "data_config.seed=4"),
        "greedy": (),
    }
    outputs = {}
    for name, overrides in runs.items():
        assert run_into(run_yaml, tmp_path / name, *overrides) == 0
        outputs[name] = {i: line["output_token_ids"] for i, line in outputs_by_id(tmp_path / name).items()}
    assert outputs["first"] == outputs["again"] == outputs["one_at_a_time"]
    assert outputs["first"] != outputs["other_seed"] and outputs["first"] != outputs["greedy"]
    assert len({tuple(tokens) for tokens in outputs["first"].values()}) == 6


def test_a_pool_that_forces_preemptions_gives_the_same_samples(tiny_llama_dir):
    """Seeds are per output index, so a request recomputed after preemption samples as before."""
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([30, 12, 25, 7, 18, 40])]
    overrides = {"temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.2}
    records = [
        PromptRecord(id=f"p{i}", prompt_token_ids=p, sampling_overrides=overrides) for i, p in enumerate(prompts)
    ]
    large = run_engine(tiny_llama_dir, records, batch_size=6)
    small = run_engine(tiny_llama_dir, records, batch_size=6, num_blocks=10, max_model_len=128)
    assert small.summary["preemptions"] > 1 and large.summary["preemptions"] == 0
    assert [r.output_token_ids for r in small.requests] == [r.output_token_ids for r in large.requests]


def test_greedy_lines_in_a_sampling_run_equal_transformers_and_logprobs_are_written(tmp_path, tiny_llama_dir):
    prompts = {"hot": [5, 6, 7], "greedy": [9, 10, 11, 12]}
    records = [
        PromptRecord(id="hot", prompt_token_ids=prompts["hot"], sampling_overrides={"temperature": 0.8, "logprobs": 4}),
        PromptRecord(
            id="greedy", prompt_token_ids=prompts["greedy"], sampling_overrides={"temperature": 0, "logprobs": 2}
        ),
        PromptRecord(id="plain", prompt_token_ids=[13, 14], sampling_overrides={"temperature": 0.8}),
    ]
    run_engine(tiny_llama_dir, records, output_dir=tmp_path, batch_size=3, max_new_tokens=8)
    lines = {line["id"]: line for line in map(json.loads, (tmp_path / "outputs.jsonl").read_text().splitlines())}
    hf = load_hf_model(tiny_llama_dir)
    assert lines["greedy"]["output_token_ids"] == hf_greedy(hf, prompts["greedy"], 8)
    assert lines["plain"]["logprobs"] is None
    for request_id, num_top in (("hot", 4), ("greedy", 2)):
        line = lines[request_id]
        assert [entry["token_id"] for entry in line["logprobs"]] == line["output_token_ids"]
        for entry in line["logprobs"]:
            top_logprobs = [lp for _, lp in entry["top"]]
            assert len(entry["top"]) == num_top and top_logprobs == sorted(top_logprobs, reverse=True)
            assert entry["logprob"] <= top_logprobs[0] + 1e-6
    # the first greedy token's logprob is transformers' log-softmax of its last prompt logits
    first = lines["greedy"]["logprobs"][0]
    expected = hf_last_logits(hf, prompts["greedy"]).log_softmax(dim=-1)
    assert first["logprob"] == first["top"][0][1] == pytest.approx(expected.max().item(), abs=1e-4)
    assert [token for token, _ in first["top"]] == expected.topk(2).indices.tolist()
