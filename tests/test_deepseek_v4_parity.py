"""models/deepseek_v4 against transformers' DeepseekV4ForCausalLM with the same weights, on the paged path.

Prompts long enough for several compressed entries (compress rates 4 and 8) run packed over
scattered blocks of NaN-filled caches; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy
tokens must equal transformers' for that prompt alone, prefilled at once or in chunks whose bounds
cut the compression windows. Routing ties and indexer ties break as transformers breaks them; the
whole engine runs with chunked prefill and a pool that preempts. Breaking a mechanism on purpose
(the compressor state across chunks, the hyper-connection mixing, the indexer's selection, the
compressed entries, the hash routing) must break the parity.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from models.deepseek_v4 import DeepseekV4ForCausalLM
from module.hyper_connection import HyperConnection
from ops.attention.metadata import ScheduledSequence
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_engine_greedy,
    generate_random_prompts,
)
from tests.factories import deepseek_v4_config
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    check_decode_traces_as_one_graph,
    hf_last_logits,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = PagedParityTests.tolerance
COMPRESS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
# name -> (DeepseekV4Config overrides, KV block size)
CONFIGS = {
    "base_blocks_of_8": ({}, 8),
    "yarn_compress_rope_three_streams_top3": (
        {"rope_parameters": COMPRESS_YARN, "hc_mult": 3, "index_topk": 3, "sliding_window": 5},
        16,
    ),
}
CHUNKS = (5, 3, 7, 2, 9, 6)  # prefill chunk sizes, in turn: none a multiple of 4 or 8
REAL_MERGE = HyperConnection.merge
REDRAWN = ("position_bias", "sinks", ".base", "hc_base", "e_score_correction_bias")  # zero in transformers' init


def save_checkpoint(path: Path, config: transformers.DeepseekV4Config, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` (DeepSeek's tensor names, as transformers saves them) and transformers'
    model with its weights: random, with what its init leaves constant drawn too (biases, sinks, norm
    weights) and a random hash table, so that each must load for parity."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(key in name for key in REDRAWN):
                param.normal_(0.0, 0.5)
            elif "norm" in name and param.dim() == 1:
                param.normal_(1.0, 0.2)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                table.copy_(torch.randint(0, config.n_routed_experts, table.shape))
    model.save_pretrained(path)
    return model


def load_ours(path: Path, config: transformers.DeepseekV4Config) -> DeepseekV4ForCausalLM:
    return paged_harness.load_ours(DeepseekV4ForCausalLM, path, config)


def parity_models(path: Path, name: str) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[name]
    config = deepseek_v4_config(**overrides)
    return save_checkpoint(path, config), PagedModel(load_ours(path, config), block_size)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    return parity_models(tmp_path_factory.mktemp(request.param), request.param)


def chunk_sizes(prompt_index: int, prompt_len: int) -> list[int]:
    """Prompt `prompt_index`'s chunks: CHUNKS in turn from its own offset, the last one cut to fit."""
    sizes, done, step = [], 0, 0
    while done < prompt_len:
        sizes.append(min(CHUNKS[(step + prompt_index) % len(CHUNKS)], prompt_len - done))
        done, step = done + sizes[-1], step + 1
    return sizes


@torch.no_grad()
def hf_chunked_last_logits(hf_model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' last-token logits of each prompt fed alone in the same chunks through its cache.
    The reference for a chunked prefill: transformers' indexer breaks exact score ties by torch.topk
    over a row as long as the entries its cache holds after the call, so a whole-prompt call and a
    chunked one may pick different tied entries (the tests below see both happen)."""
    rows = []
    for index, prompt in enumerate(prompts):
        cache, done = transformers.DynamicCache(config=hf_model.config), 0
        for size in chunk_sizes(index, len(prompt)):
            logits = hf_model(torch.tensor([prompt[done : done + size]]), cache=cache, use_cache=True).logits
            done += size
        rows.append(logits[0, -1])
    return torch.stack(rows)


def chunked_prefill_logits(
    ours: PagedModel, prompts: list[list[int]], between_steps: Callable[[], None] = lambda: None
) -> torch.Tensor:
    """The prompts prefilled packed, each in chunks of CHUNKS in turn (a step takes every unfinished
    prompt's next chunk); -> each prompt's last-token logits from the step that finished it."""
    blocks = [ours.allocate(len(p)) for p in prompts]
    sizes = [chunk_sizes(i, len(p)) for i, p in enumerate(prompts)]
    done = [0] * len(prompts)
    last: dict[int, torch.Tensor] = {}
    for step in range(max(map(len, sizes))):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        sequences = []
        for i in active:
            chunk = prompts[i][done[i] : done[i] + sizes[i][step]]
            sequences.append(ScheduledSequence(chunk, done[i], [ours.blocks_for(blocks[i], done[i] + len(chunk))]))
            done[i] += len(chunk)
        for i, row in zip(active, ours.step(sequences), strict=True):
            last[i] = row
        between_steps()
    return torch.stack([last[i] for i in range(len(prompts))])


class TestPagedParity(PagedParityTests):
    """Every family's parity tests on each of CONFIGS, with prompts that close several windows; the
    cached-prefix splits (13, 6) cut the windows of both compress rates."""

    prefill_prompt_lens = (5, 17, 1, 9, 30, 37)
    prefix_prompt_lens, prefix_splits = (29, 21), (13, 6)

    def test_chunked_prefill_at_unaligned_bounds_matches_hf_over_the_same_chunks(self, models):
        hf_model, ours = models
        prompts = random_prompts((23, 40, 11, 31), seed=6)
        difference = chunked_prefill_logits(ours, prompts) - hf_chunked_last_logits(hf_model, prompts)
        assert difference.abs().max() <= self.tolerance


@pytest.fixture(params=["experts", "indexer"], scope="module")
def tied_routing_models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    """experts: the scored routers' weights and biases zero, so every expert scores sqrt(softplus(0))
    and only top-k's tie-breaking chooses; indexer: the indexers' weights_proj zero, so every
    compressed entry scores 0 and only top-k's tie-breaking picks the entries attended to."""
    config = deepseek_v4_config()
    path = tmp_path_factory.mktemp(f"tied_{request.param}")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            if request.param == "experts" and not layer.mlp.is_hash:
                layer.mlp.gate.weight.zero_()
                layer.mlp.gate.e_score_correction_bias.zero_()
            if request.param == "indexer" and layer.self_attn.compressor is not None:
                indexer = getattr(layer.self_attn.compressor, "indexer", None)
                if indexer is not None:
                    indexer.scorer.weights_proj.weight.zero_()
    hf_model.save_pretrained(path)
    return hf_model, PagedModel(load_ours(path, config), block_size=8)


class TestRoutingTies(RoutingTieTests):
    """Experts tied in every scored layer, or compressed entries tied in every indexer; prompts long
    enough that more entries are closed than the indexer keeps."""

    tie_prompt_lens = (7, 24, 13, 33)


def forget_compressor_state(ours: PagedModel) -> None:
    """What a cache without the compressor's carry would do: every token projection gone (zeros)."""
    for layer in ours.model.model.layers:
        for name, cache in layer.attn.caches.items():
            if name.endswith(("_kv", "_gate")) and name != "kv":
                cache.zero_()


def max_diff(hf_model: torch.nn.Module, prompts: list[list[int]], logits: torch.Tensor) -> float:
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


def test_dropping_the_compressor_state_across_chunks_breaks_the_parity(tmp_path):
    hf_model, ours = parity_models(tmp_path, "base_blocks_of_8")
    prompts = random_prompts((23, 40, 31), seed=6)
    reference = hf_chunked_last_logits(hf_model, prompts)
    assert (chunked_prefill_logits(ours, prompts) - reference).abs().max() <= TOLERANCE
    dropped = chunked_prefill_logits(ours, prompts, between_steps=lambda: forget_compressor_state(ours))
    assert (dropped - reference).abs().max() > 100 * TOLERANCE


def no_sinkhorn(model: DeepseekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comb mix left a softmax, not projected onto doubly stochastic matrices."""
    for layer in model.model.layers:
        layer.hc_attn.sinkhorn_iters = layer.hc_ffn.sinkhorn_iters = 0


def unmixed_streams(model: DeepseekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hyper-connections without their comb mixing: each stream keeps itself."""

    def unmixed(post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return REAL_MERGE(post, torch.eye(comb.shape[-1]), output, streams)

    monkeypatch.setattr(HyperConnection, "merge", staticmethod(unmixed))


def attend_every_entry(model: DeepseekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compressed sparse attention without the indexer's selection: every closed entry."""
    for layer in model.model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer = None


def no_compressed_entries(model: DeepseekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compressed layers reduced to their sliding window."""
    for layer in model.model.layers:
        layer.attn.compressor = layer.attn.indexer = None


def no_hash_routing(model: DeepseekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash layer's table replaced by experts 0 and 1 for every token."""
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            layer.mlp.gate.tid2eid.copy_(torch.arange(layer.mlp.gate.top_k).expand_as(layer.mlp.gate.tid2eid))


MUTATIONS = [no_sinkhorn, unmixed_streams, attend_every_entry, no_compressed_entries, no_hash_routing]


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_breaking_a_mechanism_breaks_the_parity(mutation, tmp_path, monkeypatch):
    hf_model, ours = parity_models(tmp_path, "base_blocks_of_8")
    prompts = random_prompts((30, 37, 17), seed=1)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    assert max_diff(hf_model, prompts, logits) <= TOLERANCE
    mutation(ours.model, monkeypatch)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    assert max_diff(hf_model, prompts, logits) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "config hidden_act 'gelu'"),
        ({"o_groups": 3}, "config o_groups 3"),
        ({"index_head_dim": 4}, "config index_head_dim 4"),
    ],
)
def test_a_config_built_otherwise_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV4ForCausalLM(deepseek_v4_config(**overrides), backend=cpu_backend())


def test_block_size_must_hold_whole_compressed_windows(tmp_path):
    ours = DeepseekV4ForCausalLM(deepseek_v4_config(), backend=cpu_backend())
    spec = ours.model.layers[2].attn.kv_cache_spec()  # heavily compressed: one entry per 8 tokens
    entries = next(t for t in spec.tensors if t.name == "compressor_entries")
    assert entries.cache_shape(5, 16) == (5, 2, 16)
    with pytest.raises(ValueError, match="block_size must be a multiple of it, got 12"):
        entries.cache_shape(5, 12)


def test_mtp_modules_are_not_built_and_their_tensors_are_skipped():
    """transformers defines no V4 MTP module (it drops the checkpoints' mtp.* tensors): neither do we,
    and speculative method mtp names the reason."""
    ours = DeepseekV4ForCausalLM(deepseek_v4_config(num_nextn_predict_layers=1), backend=cpu_backend())
    assert ours.num_mtp_layers == 0 and "transformers does not define them" in ours.mtp_absent_reason
    assert (
        ours.load_weights([("mtp.0.enorm.weight", torch.ones(32)), ("model.mtp.0.eh_proj.weight", torch.ones(1))])
        == set()
    )


@pytest.mark.slow
def test_decode_traces_as_one_graph(tmp_path):
    """ge_graph's requirement: a padded decode step compiles as one graph and equals eager."""
    _, ours = parity_models(tmp_path, "base_blocks_of_8")
    check_decode_traces_as_one_graph(ours, random_prompts((9, 17, 30), seed=7))


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine on a saved tiny checkpoint, found by cann-recipes' name, with prefill chunks
    of at most 13 tokens (cutting windows of 4 and 8) and 19 usable blocks of 16 tokens shared by
    the three cache groups (sliding, compressed sparse, heavily compressed), for a batch whose
    requests need up to 5 blocks per group each: chunked prompts and preempted requests.

    Eight indexer heads: an entry scores exactly 0 only where all eight ReLUs are 0, so exact
    ties between entries are rare. At an exact tie, transformers' own choice depends on how it was
    called (hf_chunked_last_logits), and a chunked or recomputed prefill is not generate()'s call."""
    config = deepseek_v4_config(**ENGINE_CONFIG, index_n_heads=8)
    path = tmp_path_factory.mktemp("tiny_deepseek_v4")
    hf_model = save_checkpoint(path, config)
    run = generate_random_prompts(path, "deepseek_v4", **ENGINE_SCHEDULER)
    return hf_model, path, *run


ENGINE_SCHEDULER = dict(max_prefill_tokens=13, num_blocks=20, max_model_len=80)


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, _, inference, prompts, result = engine_run
    assert isinstance(inference.engine.worker.model, DeepseekV4ForCausalLM)
    assert len(inference.engine.worker.kv_cache_groups) == 3
    assert result.summary["preemptions"] > 0
    assert all(step.num_tokens <= 13 for step in result.steps if step.phase == "prefill")
    check_engine_greedy(hf_model, prompts, result)
