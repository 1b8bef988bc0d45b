"""Context parallel (parallel_config.cp_size): which steps are split (those holding a prefill), the
split of a step's tokens over the ranks, the rows each rank runs, every rank's random samples alike,
cp_mini_batch's cap on a prefill step, the refusals, and (slow, under torchrun on gloo) greedy outputs
equal to one process's at CP 2 and 4, on prompts of several blocks, prefilled in chunks, with and
without prefix caching, on the tiny Llama and the tiny DeepSeek-V3 (MLA + MoE); at CP 2 in ge_graph
with n-gram (Llama) and MTP (DeepSeek-V3) drafts, the decode and verify steps in their graphs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from executor.core.config import ConfigError, build_config
from executor.core.config.model_registry import resolve_model
from executor.core.config.parallel_layout import ParallelLayout
from executor.core.engine.context_parallel import (
    gather_order,
    layers_without_context_parallel,
    local_layout,
    rank_rows,
    request_share,
    splits_step,
)
from executor.core.sampler import Sampler, SamplingMetadata, request_seed
from executor.types_ import Request, SamplingParams
from module.parallel_group import ONE_PROCESS
from ops import torch_ref
from ops.attention.metadata import ScheduledSequence, build_step_layout
from tests import deepseek_v3_harness
from tests.backends import reference_backend
from tests.dist_harness import (
    DistRun,
    max_logprob_difference,
    parallel_overrides,
    run_distributed,
    run_one_process,
    token_ids,
)
from tests.run_harness import summary

ROOT = Path(__file__).resolve().parents[1]


# -- the split -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 16, 37])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_every_token_of_a_request_goes_to_exactly_one_rank(num_tokens, cp_size):
    for request_index in range(3):
        taken = sorted(
            offset
            for rank in range(cp_size)
            for part in request_share(num_tokens, request_index, cp_size, rank)
            for offset in part
        )
        assert taken == list(range(num_tokens))


def test_a_rank_takes_a_head_segment_and_its_mirror_at_the_tail():
    """16 tokens at CP 2: four segments of 4; rank 0 takes the first and the last, rank 1 the middle two."""
    assert request_share(16, 0, 2, 0) == (range(0, 4), range(12, 16))
    assert request_share(16, 0, 2, 1) == (range(4, 8), range(8, 12))
    # the next request's deal turns by one rank
    assert request_share(16, 1, 2, 1) == (range(0, 4), range(12, 16))


def test_the_causal_work_is_balanced_over_the_ranks():
    """Each query attends over its position + 1 keys: the head-tail split gives every rank the same sum."""
    work = [sum(p + 1 for part in request_share(64, 0, 4, rank) for p in part) for rank in range(4)]
    assert len(set(work)) == 1, work


def test_requests_of_one_token_are_dealt_to_each_rank_in_turn():
    query_ends = [1, 2, 3, 4, 5]  # five requests, one token each (prompts of one token)
    owners = {row: rank for rank in range(2) for _, rows in rank_rows(query_ends, 2, rank) for row in rows}
    assert [owners[row] for row in range(5)] == [0, 1, 0, 1, 0]


def sequence(num_tokens: int, computed: int, blocks: list[int], sampled: int = 1) -> ScheduledSequence:
    return ScheduledSequence(list(range(100, 100 + num_tokens)), computed, [blocks], num_sampled_rows=sampled)


def test_only_a_step_holding_a_row_it_does_not_sample_is_split():
    """Prompt rows (a chunk, a last chunk of several tokens) split the step; decode rows and a verify
    step's 1 + k rows, all sampled, run whole on every rank, as does a prompt of one token."""
    decode, verify = sequence(1, 9, [1, 2, 3]), sequence(3, 9, [1, 2, 3], sampled=3)
    chunk, last_chunk = sequence(8, 0, [4, 5], sampled=0), sequence(5, 8, [4, 5, 6])
    assert not splits_step([decode, verify])
    assert not splits_step([sequence(1, 0, [7])])
    assert splits_step([chunk]) and splits_step([last_chunk])
    assert splits_step([decode, last_chunk])


BLOCK = 4


def test_a_ranks_layout_runs_each_segment_over_its_requests_blocks_after_its_prefix():
    """A chunk of 8 tokens after 4 computed ones (blocks 5, 6, 7) and a prompt of 3 (block 9) at CP 2:
    rank 0 computes rows 0-1 and 6-7 of the chunk and the prompt's first two tokens (its segments 1 and 2
    of 4, the deal turned by one for the second request)."""
    layout = build_step_layout(
        [sequence(8, 4, [5, 6, 7]), sequence(3, 0, [9])], block_size=BLOCK, max_blocks_per_request=4
    )
    shares = rank_rows(layout.query_ends, 2, 0)
    assert shares == [(0, range(0, 2)), (0, range(6, 8)), (1, range(8, 9)), (1, range(9, 10))]
    local = local_layout(layout, shares)
    assert local.positions == [4, 5, 10, 11, 0, 1]
    assert local.input_ids == [100, 101, 106, 107, 100, 101]
    assert local.query_ends == [2, 4, 5, 6]
    assert local.seq_lens == [6, 12, 1, 2]  # each segment's K/V: its prefix and itself
    assert local.block_ids == [[[5, 6, 7], [5, 6, 7], [9], [9]]]
    assert local.slot_mappings == [[24, 25, 30, 31, 36, 37]]  # block * 4 + offset of each local token


def test_a_rank_with_no_rows_runs_one_padding_row_on_the_null_block():
    layout = build_step_layout([sequence(1, 5, [3, 4])], block_size=BLOCK, max_blocks_per_request=4)
    (idle_rank,) = [rank for rank in range(2) if not rank_rows(layout.query_ends, 2, rank)]
    local = local_layout(layout, rank_rows(layout.query_ends, 2, idle_rank))
    assert (local.input_ids, local.positions, local.seq_lens, local.slot_mappings) == ([0], [0], [1], [[0]])
    assert local.block_ids == [[[]]]  # an all-null block table row


def test_gathered_rows_are_put_back_in_the_steps_order():
    rows_per_rank = [[0, 1, 6, 7], [], [2, 3, 4, 5]]
    # rank 0's four rows, rank 1's padding row, then rank 2's
    assert gather_order(rows_per_rank, 8) == [0, 1, 5, 6, 7, 8, 2, 3]


# -- configuration and scheduling ----------------------------------------------------------------


def test_cp_size_must_be_one_or_the_world_size_with_attention_tp_1():
    with pytest.raises(ConfigError) as err:
        build_config({"parallel_config": {"world_size": 4, "cp_size": 2}}, source="run.yaml")
    assert "parallel_config.cp_size 2 must be 1 or world_size (4)" in str(err.value)
    assert "run.yaml" in str(err.value)
    with pytest.raises(ConfigError, match="attn_tp_size 2 must be 1 with cp_size 4"):
        build_config({"parallel_config": {"world_size": 4, "cp_size": 4, "attn_tp_size": 2}})
    config = build_config({"parallel_config": {"world_size": 4, "cp_size": 4}})
    assert ParallelLayout.from_config(config.parallel_config).attn_dp_size == 1  # one replica


def test_under_context_parallel_every_model_group_but_the_lm_heads_holds_different_tokens():
    layout = ParallelLayout(world_size=4, cp_size=4, embed_tp_size=2, lmhead_tp_size=2, dense_tp_size=2)
    assert layout.groups("cp") == [[0, 1, 2, 3]] == layout.groups("replica")
    assert [layout.holds_different_tokens(kind) for kind in ("embed_tp", "dense_tp", "moe_ep")] == [True] * 3
    assert not layout.holds_different_tokens("lmhead_tp")  # the runner gathers its rows first
    assert not layout.lock_step_kinds(has_experts=True)  # every rank runs the same steps anyway


def test_cp_mini_batch_caps_the_requests_of_a_prefill_step_under_context_parallel_only():
    settings = {"scheduler_config": {"cp_mini_batch": 2, "batch_size": 8}, "data_config": {"input_truncated_len": 10}}
    config = build_config(settings | {"parallel_config": {"world_size": 4, "cp_size": 4}})
    assert config.max_prefill_requests == 2
    assert config.prefill_token_budget == 10 * 2  # cann-recipes' budget: truncated length x the cap
    assert build_config(settings).max_prefill_requests == 0


def seeded_requests(seeded: bool) -> list[Request]:
    """Three requests sampling at temperature 1, each with its own seed as the offline runner gives one."""
    seeds = [request_seed(0, f"r{i}") if seeded else None for i in range(3)]
    return [Request(f"r{i}", None, [3, 4], SamplingParams(temperature=1.0, seed=seed)) for i, seed in enumerate(seeds)]


def test_ranks_sampling_the_same_logits_sample_the_same_random_tokens():
    """A decode or verify step runs whole on every rank, each sampling its own (equal) logits: every
    request the offline runner makes has a seed (request_seed), whose noise depends on the seed and
    the output index alone, so the ranks agree even where their run generators had drawn differently;
    without seeds they would not."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))

    def sample_on_two_ranks(requests: list[Request]) -> list[list[int]]:
        ranks = [Sampler(0, "cpu", torch_ref.argmax_rows), Sampler(0, "cpu", torch_ref.argmax_rows)]
        ranks[1].noise.run_generator.manual_seed(1)  # a run generator with another history
        return [rank.sample(logits, SamplingMetadata.build(requests, "cpu")).token_ids.tolist() for rank in ranks]

    first, second = sample_on_two_ranks(seeded_requests(seeded=True))
    assert first == second
    first, second = sample_on_two_ranks(seeded_requests(seeded=False))
    assert first != second


@pytest.mark.parametrize(
    ("family", "refused"),
    [
        ("qwen3", []),  # full attention
        ("gemma_4", []),  # sliding-window and KV-shared layers
        ("deepseek_v3", []),  # MLA
        ("deepseek_v3_2", []),  # DSA: its indexer's key cache is gathered as MLA's latents are
        ("deepseek_v4", ["DeepseekV4Attention"]),  # compressed KV
        ("qwen3_next", ["Qwen3NextGatedDeltaNet"]),  # recurrent state
    ],
)
def test_models_whose_caches_cannot_take_a_step_in_shares_are_named(family, refused):
    """What the engine refuses under context parallel once the model is built, before its weights load."""
    model_cls, config_cls = resolve_model(family)
    model = model_cls(
        config_cls.from_pretrained(ROOT / f"models/{family}/tiny_random"),
        parallel=ONE_PROCESS,
        backend=reference_backend(),
    )
    assert layers_without_context_parallel(model) == refused


# -- several processes (slow) --------------------------------------------------------------------

# Three prompts of 40, 35 and 19 tokens over blocks of 8, prefilled in chunks of 24 tokens, two
# requests at a time: r1 shares r0's first 24 tokens, so with prefix caching it starts after r0's
# first 3 blocks; r2 waits for a free slot and prefills while the others decode.
PROMPTS = {
    "r0": [(7 * i) % 200 + 3 for i in range(40)],
    "r1": [(7 * i) % 200 + 3 for i in range(24)] + [(11 * i) % 200 + 5 for i in range(11)],
    "r2": [(13 * i) % 200 + 4 for i in range(19)],
}
SETTINGS = [
    "scheduler_config.block_size=8",
    "scheduler_config.max_prefill_tokens=24",
    "scheduler_config.batch_size=2",
    "scheduler_config.max_new_tokens=5",
    "data_config.logprobs=0",
]
NO_PREFIX_CACHING = "scheduler_config.enable_prefix_caching=false"
FP32_REORDER_BOUND = 1e-4  # the experts' and the attention's sums run in another order
# DeepSeek sparse attention picks its top-k keys from fp32 scores whose rounding depends on the rows a
# step holds: a near-tie flips, and a token's logprob moves. One process alone moves r1's 4th logprob
# by 0.026 between batch 1 and batch 2 (the tokens stay equal); CP 2 moved it by 0.031.
DSA_SELECTION_BOUND = 0.05


def write_long_run(
    tmp_path: Path, model_dir: Path, model_name: str, prompts: dict[str, list[int]] | None = None
) -> Path:
    dataset = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": key, "prompt_token_ids": ids}) + "\n" for key, ids in (prompts or PROMPTS).items()]
    dataset.write_text("".join(lines))
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        f"model_config:\n  model_name: {model_name}\n  model_path: {model_dir}\n  dtype: float32\n  device: cpu\n"
        f"data_config:\n  dataset_path: {dataset}\n"
        "scheduler_config:\n  ignore_eos: true\n"
    )
    return run_yaml


def save_tiny_model(path: Path, family: str, num_mtp_modules: int = 0) -> Path:
    """The model of models/<family>/tiny_random with random weights saved, so that every rank reads the
    same experts; `num_mtp_modules` MTP modules. DeepSeek-V3: MLA, a dense layer then MoE layers with 16
    experts. GLM-5 adds DeepSeek sparse attention (index_topk cut to 8 so that the 40-token prompts select)."""
    source = ROOT / f"models/{family}/tiny_random"
    hf_cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM, "glm_5": transformers.GlmMoeDsaForCausalLM}[family]
    config = hf_cls.config_class.from_pretrained(source)
    config.num_nextn_predict_layers = num_mtp_modules
    if family == "glm_5":
        config.index_topk = 8
    deepseek_v3_harness.save_checkpoint(path, config, hf_model_cls=hf_cls)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, tiny_llama_dir) -> Callable[[str], tuple[Path, dict[str, dict]]]:
    """A family's run file and its one-process outputs, made on first use (prefix caching on: it
    changes no token)."""

    @functools.cache
    def run(family: str) -> tuple[Path, dict[str, dict]]:
        tmp = tmp_path_factory.mktemp(f"cp_{family}")
        model_dir = tiny_llama_dir if family == "llama" else save_tiny_model(tmp / "model", family)
        run_yaml = write_long_run(tmp, model_dir, family)
        return run_yaml, run_one_process(run_yaml, tmp / "one_process", *SETTINGS)

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "cp_size", "prefix_caching"),
    [
        ("llama", 2, True),
        ("llama", 4, False),
        ("deepseek_v3", 2, False),
        ("deepseek_v3", 4, True),
        pytest.param("glm_5", 2, True, marks=pytest.mark.long),
    ],
)
def test_context_parallel_gives_one_process_tokens(one_process_run, family, cp_size, prefix_caching, tmp_path):
    run_yaml, reference = one_process_run(family)
    overrides = [*SETTINGS, *parallel_overrides(cp_size, cp_size=cp_size)]
    run = run_distributed(run_yaml, tmp_path / "cp", overrides if prefix_caching else [*overrides, NO_PREFIX_CACHING])
    assert run.returncode == 0, run.output[-4000:]
    assert token_ids(run.outputs()) == token_ids(reference)
    bound = DSA_SELECTION_BOUND if family == "glm_5" else FP32_REORDER_BOUND
    assert max_logprob_difference(run.outputs(), reference) <= bound
    assert_prefilled_in_shares(run, family, prefix_caching)


def assert_prefilled_in_shares(run: DistRun, family: str, prefix_caching: bool) -> None:
    """Every prefill step gathered K/V (or MLA latents) over the CP group, no decode step did (each
    rank ran it whole); r1's prefix hit happened only with caching."""
    assert (summary(run.out)["prefix_cache_hit_tokens"] == 24) is prefix_caching
    steps = run.steps()
    assert {step["phase"] for step in steps} == {"prefill", "decode"}
    for step in steps:
        assert (step["comm_bytes"].get("cp.gather_rows", 0) > 0) is (step["phase"] == "prefill")
        if family != "llama":  # the experts are split over the ranks (EP = cp) in every step
            assert step["comm_bytes"]["moe_ep.gather_rows"] > 0


# -- graph modes and speculative decoding (slow) -------------------------------------------------

# r0 repeats a run of 10 tokens, so n-gram drafts from its first decode step on; r1 shares its first
# 24 tokens (a prefix cache hit of 3 blocks with caching on).
LOOP = [(7 * i) % 200 + 3 for i in range(10)]
REPEATING_PROMPTS = {"r0": LOOP * 4, "r1": (LOOP * 3)[:24] + PROMPTS["r1"][24:], "r2": PROMPTS["r2"]}
K = 2
GRAPHS_WITH_DRAFTS = [
    "model_config.exe_mode=ge_graph",
    "scheduler_config.graph_buckets=[2]",  # one bucket: decode steps in 2, verify steps in 2x3
    "scheduler_config.max_new_tokens=8",
    f"speculative_config.num_speculative_tokens={K}",
]


def assert_decode_and_verify_steps_in_graphs(run: DistRun, reference: dict[str, dict]) -> dict:
    """One process's eager greedy tokens without drafts; every decode and verify step in the bucket's
    graphs, run whole on each rank (no CP gather), every prefill step split (eager). The graph stats."""
    assert run.returncode == 0, run.output[-4000:]
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
    steps = run.steps()
    decode_steps = [step for step in steps if step["phase"] == "decode"]
    graph = summary(run.out)["parts"][-1]["graph"]
    assert sum(graph["graph_steps_per_bucket"].values()) == len(decode_steps) > 0
    assert graph["graph_steps_per_bucket"].get(f"2x{1 + K}", 0) > 0, "no verify step ran in its graph"
    assert graph["eager_steps"] == 0  # the split prefill steps never ask the graph runner
    for step in steps:
        assert (step["comm_bytes"].get("cp.gather_rows", 0) > 0) is (step["phase"] == "prefill")
    return graph


@pytest.mark.slow
def test_ngram_drafts_in_ge_graph_under_context_parallel_give_one_process_tokens(tiny_llama_dir, tmp_path):
    """CP 2 on the tiny Llama, prefix caching on."""
    run_yaml = write_long_run(tmp_path, tiny_llama_dir, "llama", REPEATING_PROMPTS)
    reference = run_one_process(run_yaml, tmp_path / "one_process", *SETTINGS, "scheduler_config.max_new_tokens=8")
    overrides = [*SETTINGS, *GRAPHS_WITH_DRAFTS, "speculative_config.method=ngram"]
    overrides.append("speculative_config.prompt_lookup_min=1")
    run = run_distributed(run_yaml, tmp_path / "cp", [*overrides, *parallel_overrides(2, cp_size=2)])
    assert_decode_and_verify_steps_in_graphs(run, reference)
    assert summary(run.out)["prefix_cache_hit_tokens"] == 24


@pytest.mark.slow
def test_mtp_drafts_in_ge_graph_under_context_parallel_give_one_process_tokens(tmp_path):
    """CP 2 on the tiny DeepSeek-V3 with one MTP module (random: its drafts are rejected), prefix caching
    off: the MTP pass after each split prefill reads every prompt row's hidden state, gathered over the
    CP group; its later passes run in the MTP layer's graphs."""
    model_dir = save_tiny_model(tmp_path / "model", "deepseek_v3", num_mtp_modules=1)
    run_yaml = write_long_run(tmp_path, model_dir, "deepseek_v3")
    settings = [*SETTINGS, NO_PREFIX_CACHING, "scheduler_config.max_new_tokens=8"]
    reference = run_one_process(run_yaml, tmp_path / "one_process", *settings)
    overrides = [*settings, *GRAPHS_WITH_DRAFTS, "speculative_config.method=mtp"]
    run = run_distributed(run_yaml, tmp_path / "cp", [*overrides, *parallel_overrides(2, cp_size=2)])
    graph = assert_decode_and_verify_steps_in_graphs(run, reference)
    assert sum(graph["mtp"]["mtp0"]["graph_steps_per_bucket"].values()) > 0
