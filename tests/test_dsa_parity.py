"""models/deepseek_v3_2 and models/glm_5 against transformers' DeepseekV32ForCausalLM and
GlmMoeDsaForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered blocks of NaN-filled caches (the latent and the
indexer's keys); each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal
transformers' for that prompt alone. The indexer keeps 6 tokens, fewer than most prompts hold, so
its selection decides what the attention sees. GLM-5 runs with IndexShare (a shared layer reusing
the selection before it, a second cache group). Indexer ties break as transformers' torch.topk
breaks them; the whole engine runs with chunked prefill and a pool that preempts; taking the first
k tokens in place of the indexer's choice, an indexer without its weights, or GLM-5's indexer rope
not interleaved must break the parity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from models.deepseek_v3_2 import DeepseekV32ForCausalLM
from models.glm_5 import GlmMoeDsaForCausalLM
from module.dsa import SparseMLAAttention
from ops.attention.metadata import ScheduledSequence
from ops.sparse_attention import NOT_SELECTED
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_engine_greedy,
    engine_prefill_logits,
    generate_random_prompts,
    make_inference,
)
from tests.factories import DSA_SETTINGS, dsa_config, tiny_tokenizer
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    hf_last_logits,
    random_prompts,
    save_random_model,
    single_thread,  # noqa: F401 (an autouse fixture)
)

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = PagedParityTests.tolerance
TOPK = DSA_SETTINGS["index_topk"]

# family -> (transformers' class, ours, cann-recipes' name, model folder)
FAMILIES = {
    "deepseek_v32": (transformers.DeepseekV32ForCausalLM, DeepseekV32ForCausalLM, "deepseek_v3_2_exp", "deepseek_v3_2"),
    "glm_moe_dsa": (transformers.GlmMoeDsaForCausalLM, GlmMoeDsaForCausalLM, "glm_5", "glm_5"),
}
# name -> (family, config overrides, KV block size)
CONFIGS = {
    "deepseek_v32": ("deepseek_v32", {}, 4),
    "deepseek_v32_yarn_biases_two_dense": (
        "deepseek_v32",
        {
            "attention_bias": True,
            "first_k_dense_replace": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 0.9,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "rope_theta": 10000.0,
            },
        },
        16,
    ),
    "glm_5_index_share": ("glm_moe_dsa", {"num_hidden_layers": 4, "index_topk_pattern": "FSFS"}, 8),
}
GLM_SHARE = {"index_topk_pattern": "FFS"}  # the engine's GLM-5: its third layer shares the second's selection


def save_checkpoint(path: Path, config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` and transformers' model with its weights: random, the linear
    biases and norm weights and biases (the indexer's LayerNorm too) drawn as well."""
    hf_cls = FAMILIES[config.model_type][0]
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1)}
    return save_random_model(path, hf_cls, config, seed, redraw=redraw)


def load_ours(path: Path, config: transformers.PretrainedConfig) -> torch.nn.Module:
    return paged_harness.load_ours(FAMILIES[config.model_type][1], path, config)


def parity_models(path: Path, name: str) -> tuple[torch.nn.Module, PagedModel]:
    family, overrides, block_size = CONFIGS[name]
    return paged_harness.parity_models(path, dsa_config(family, **overrides), save_checkpoint, load_ours, block_size)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    return parity_models(tmp_path_factory.mktemp(request.param), request.param)


class TestPagedParity(PagedParityTests):
    """Every family's parity tests (prefill, cached prefix, padded batched decode) on each of CONFIGS."""

    def test_the_indexer_keeps_fewer_tokens_than_the_prompts_hold(self, models):
        assert sorted(self.prefill_prompt_lens)[-3] > TOPK and max(self.decode_prompt_lens) > TOPK


def max_prefill_diff(hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]]) -> float:
    """The largest |ours - transformers'| over the last-token logits of `prompts` prefilled packed."""
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


def indexers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m.indexer for m in model.modules() if isinstance(m, SparseMLAAttention) and m.indexer is not None]


def first_k_tokens(model: torch.nn.Module) -> None:
    """Every indexer selects the first k visible tokens of its request instead of its best ones."""

    def first_k(query, weights, index_cache, block_table, forward_metadata, softmax_scale, topk, index_scale=None):
        ends, lengths = forward_metadata.query_ends.tolist(), forward_metadata.seq_lens.tolist()
        rows = []
        for start, end, length in zip([0, *ends[:-1]], ends, lengths, strict=True):
            for position in range(length - (end - start), length):
                picks = list(range(min(topk, position + 1)))
                rows.append(picks + [NOT_SELECTED] * (topk - len(picks)))
        return torch.tensor(rows)

    for indexer in indexers(model):
        indexer.ops = dataclasses.replace(indexer.ops, indexer_topk=first_k)


def indexer_weights_dropped(model: torch.nn.Module) -> None:
    """The indexers' projections zeroed, as if their checkpoint tensors had not loaded: every score ties."""
    with torch.no_grad():
        for indexer in indexers(model):
            for param in indexer.parameters():
                param.zero_()


def indexer_rope_half_split(model: torch.nn.Module) -> None:
    """GLM-5's indexer roped as DeepSeek-V3.2's is (half-split pairs) instead of interleaved."""
    for indexer in indexers(model):
        indexer.interleaved_rope = False


@pytest.mark.parametrize(
    ("config", "mutation"),
    [
        ("deepseek_v32", first_k_tokens),
        ("deepseek_v32", indexer_weights_dropped),
        ("glm_5_index_share", first_k_tokens),
        ("glm_5_index_share", indexer_weights_dropped),
        ("glm_5_index_share", indexer_rope_half_split),
    ],
)
def test_a_broken_selection_breaks_the_parity(config: str, mutation: Callable[[torch.nn.Module], None], tmp_path):
    hf_model, ours = parity_models(tmp_path, config)
    prompts = random_prompts(PagedParityTests.prefill_prompt_lens, seed=1)
    assert max_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    mutation(ours.model)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


@pytest.fixture(params=["deepseek_v32", "glm_5_index_share"], scope="module")
def tied_indexer_models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    """Every indexer's wq_b zero in the checkpoint: each query's scores are all 0, so every visible
    token ties for the top-k places and only torch.topk's tie-breaking chooses."""
    family, overrides, block_size = CONFIGS[request.param]
    config = dsa_config(family, **overrides)
    path = tmp_path_factory.mktemp(f"tied_{request.param}")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.wq_b.weight.zero_()
    hf_model.save_pretrained(path)
    return hf_model, PagedModel(load_ours(path, config), block_size)


def test_indexer_ties_break_as_in_transformers(tied_indexer_models):
    hf_model, ours = tied_indexer_models
    prompts = random_prompts((7, 14, 10), seed=4)
    paged_harness.check_prefill_logits(hf_model, ours, prompts, TOLERANCE)
    paged_harness.check_batched_greedy(hf_model, ours, prompts, 8)


@pytest.fixture(params=list(FAMILIES), scope="module")
def engine_run(request, tmp_path_factory):
    """The whole engine on a saved tiny checkpoint, found by cann-recipes' name, with prefill chunks
    of at most 16 tokens and a pool of 16-token blocks too small for the batch (GLM-5's two cache
    groups take twice the blocks): chunked prompts and preempted requests."""
    family = request.param
    config = dsa_config(family, **ENGINE_CONFIG, **(GLM_SHARE if family == "glm_moe_dsa" else {}))
    path = tmp_path_factory.mktemp(f"tiny_{family}")
    hf_model = save_checkpoint(path, config)
    num_blocks = 19 if family == "glm_moe_dsa" else 10
    name = FAMILIES[family][2]
    run = generate_random_prompts(path, name, max_prefill_tokens=16, num_blocks=num_blocks, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    assert isinstance(inference.engine.worker.model, FAMILIES[hf_model.config.model_type][1])
    assert result.summary["preemptions"] > 0
    assert max(len(p) for p in prompts) > 16 and max(len(p) for p in prompts) > TOPK
    assert all(step.num_tokens <= 16 for step in result.steps if step.phase == "prefill")
    check_engine_greedy(hf_model, prompts, result)


def test_a_glm_config_whose_first_layer_shares_a_selection_is_refused():
    with pytest.raises(ValueError, match="indexer_types\\[0\\] 'shared'"):
        GlmMoeDsaForCausalLM(dsa_config("glm_moe_dsa", index_topk_pattern="SFF"), backend=cpu_backend())


def test_a_c8_cache_holds_the_indexer_keys_in_int8_and_stays_near_the_float_cache(tmp_path):
    """model_config.quantization c8 (dynamic): every layer's latent and indexer key are int8 with a
    scale per token, and the prefill logits stay near the float cache's."""
    save_checkpoint(tmp_path, dsa_config("deepseek_v32", **ENGINE_CONFIG))
    tiny_tokenizer().save_pretrained(tmp_path)
    prompts = random_prompts((9, 20, 14), seed=6)
    logits = {}
    for quantization in (None, "c8"):
        model_config = {"model_name": "deepseek_v3_2_exp"} | ({"quantization": quantization} if quantization else {})
        inference = make_inference(tmp_path, model_config=model_config, num_blocks=32, max_model_len=128)
        logits[quantization] = engine_prefill_logits(inference, prompts)
    specs = [m.kv_cache_spec() for m in inference.engine.worker.model.modules() if isinstance(m, SparseMLAAttention)]
    for spec in specs:
        assert {t.name: t.dtype for t in spec.tensors} == {
            "latent": torch.int8,
            "latent_scale": torch.float32,
            "index_key": torch.int8,
            "index_key_scale": torch.float32,
        }
    scale = logits[None].abs().max()
    assert (logits["c8"] - logits[None]).abs().max() <= 0.1 * scale
