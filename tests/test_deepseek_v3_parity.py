"""models/deepseek_v3 against transformers' DeepseekV3ForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered blocks of a NaN-filled latent cache; each prompt's
logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal transformers' for that prompt
alone. Prefill takes the naive MLA form, decode the absorbed one; the configs cover q_lora_rank set
and None, interleaved and plain rope, yarn scaling, dense and MoE layers, and routing ties.
"""

from __future__ import annotations

import pytest
import torch

import ops
from executor.core.engine.step_inputs import ScheduledSequence
from tests.conftest import tiny_tokenizer
from tests.deepseek_v3_harness import (
    PagedModel,
    deepseek_config,
    hf_generate,
    hf_last_logits,
    load_ours,
    random_prompts,
    save_checkpoint,
    single_thread,  # noqa: F401 (an autouse fixture)
)
from tests.engine_harness import hf_greedy, make_inference, token_records

TOLERANCE = 1e-4
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.9,  # != mscale_all_dim: both the cos/sin factor and the softmax scale change
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
}
# name -> (DeepseekV3Config overrides, KV block size)
CONFIGS = {
    "q_lora_interleaved_rope": ({}, 4),
    "no_q_lora_yarn_biases_two_shared": (
        {
            "q_lora_rank": None,
            "rope_parameters": YARN,
            "rope_interleave": False,
            "attention_bias": True,
            "norm_topk_prob": False,
            "n_shared_experts": 2,
        },
        16,
    ),
    "tied_two_dense_layers_one_group_of_two": (
        {
            "tie_word_embeddings": True,
            "first_k_dense_replace": 2,
            "num_hidden_layers": 4,
            "n_group": 2,
            "topk_group": 1,
        },
        8,
    ),
}
PREFILL_PROMPT_LENS = [5, 17, 1, 9, 12]
DECODE_PROMPT_LENS = [3, 11, 6, 1, 15, 8]
MAX_NEW_TOKENS = 16


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    ops.set_backend("torch")
    overrides, block_size = CONFIGS[request.param]
    config = deepseek_config(**overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(path, config)
    return hf_model, PagedModel(load_ours(path, config), block_size)


def test_packed_prefill_logits_match_hf_per_prompt(models):
    hf_model, ours = models
    prompts = random_prompts(PREFILL_PROMPT_LENS, seed=1)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    assert logits.shape == (len(prompts), hf_model.config.vocab_size)
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE


def test_prefill_over_a_cached_prefix_matches_hf_on_the_whole_prompt(models):
    hf_model, ours = models
    prompts = random_prompts([13, 8], seed=2)
    splits = [7, 3]
    blocks = [ours.allocate(len(p)) for p in prompts]
    ours.step([ScheduledSequence(p[:s], 0, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    logits = ours.step([ScheduledSequence(p[s:], s, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE


def test_batched_greedy_decoding_matches_hf_generate_per_prompt(models):
    """Decode steps padded to a bucket of 8 rows, as a graph would run them: padding rows read and
    write only the null block."""
    hf_model, ours = models
    prompts = random_prompts(DECODE_PROMPT_LENS, seed=3)
    outputs = ours.greedy(prompts, MAX_NEW_TOKENS, pad_to=8)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_generate(hf_model, prompt, MAX_NEW_TOKENS)


# Every router's logits are 0 (gate weights zero), so each expert's score is sigmoid(0) = 0.5 and
# only these score-correction biases (exact in binary) order them: groups {0,1}, {2,3}, {4,5} all
# score 1.375 (their two best biased scores summed) and tie for the topk_group=2 places; the kept
# groups' second experts then tie for the last of the top_k=3 places.
TIE_BIASES = torch.tensor([0.25, 0.125, 0.25, 0.125, 0.25, 0.125, 0.0, 0.0])
EXPERTS_PER_GROUP = 2


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    ops.set_backend("torch")
    config = deepseek_config(num_hidden_layers=2)  # layer 1 is the MoE layer
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        router = hf_model.model.layers[1].mlp.gate
        router.weight.zero_()
        router.e_score_correction_bias.copy_(TIE_BIASES)
    hf_model.save_pretrained(path)  # the same checkpoint with the tied router
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


def test_tie_config_ties_groups_and_experts_at_the_cut(tied_routing_models):
    hf_model, _ = tied_routing_models
    _, _, topk_ids = hf_model.model.layers[1].mlp.gate(torch.randn(1, hf_model.config.hidden_size))
    chosen = set(topk_ids[0].tolist())
    biased = 0.5 + TIE_BIASES
    group_scores = biased.view(-1, EXPERTS_PER_GROUP).topk(2, dim=-1)[0].sum(-1)
    kept_groups = {expert // EXPERTS_PER_GROUP for expert in chosen}
    last_kept = min(group_scores[g] for g in kept_groups)
    assert any(group_scores[g] == last_kept for g in range(len(group_scores)) if g not in kept_groups)
    last_chosen = min(biased[e] for e in chosen)
    in_kept_groups = [e for e in range(len(biased)) if e // EXPERTS_PER_GROUP in kept_groups]
    assert any(biased[e] == last_chosen for e in in_kept_groups if e not in chosen)


def test_routing_ties_break_as_in_transformers(tied_routing_models):
    hf_model, ours = tied_routing_models
    prompts = random_prompts([7, 4, 10], seed=4)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE
    outputs = ours.greedy(prompts, 8)
    assert outputs == [hf_generate(hf_model, p, 8) for p in prompts]


ENGINE_PROMPT_LENS = [1, 5, 17, 33, 8, 40, 3]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint with one MTP
    module, whose attention gets its latent cache like every other layer."""
    ops.set_backend("torch")
    config = deepseek_config(
        num_nextn_predict_layers=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    path = tmp_path_factory.mktemp("tiny_deepseek_v3")
    hf_model = save_checkpoint(path, config)
    tiny_tokenizer().save_pretrained(path)
    inference = make_inference(path, model_config={"model_name": "deepseek_v3"}, batch_size=len(ENGINE_PROMPT_LENS))
    prompts = random_prompts(ENGINE_PROMPT_LENS, seed=5)
    result = inference.generate(token_records(prompts))
    return config, hf_model, inference, prompts, result


def test_engine_greedy_equals_transformers_generate(engine_run):
    _, hf_model, _, prompts, result = engine_run
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf_model, p, 32) for p in prompts]


def test_latent_cache_holds_kv_lora_rank_plus_rope_per_token_per_layer(engine_run):
    config, _, inference, _, _ = engine_run
    worker = inference.engine.worker
    width = config.kv_lora_rank + config.qk_rope_head_dim
    layers = list(worker.kv_cache_layers.values())
    assert len(layers) == config.num_hidden_layers + 1  # the MTP module's attention too
    assert len(worker.kv_cache_groups) == 1  # one spec: one block table for all
    block_size = inference.config.scheduler_config.block_size
    assert worker.kv_cache_bytes_per_block(block_size) == len(layers) * block_size * width * 4  # fp32
    for layer in layers:
        caches = layer.kv_caches()
        assert list(caches) == ["latent"]
        latent = caches["latent"]
        assert latent.shape[1:] == (block_size, width)
        assert latent.nbytes == latent.shape[0] * block_size * width * torch.float32.itemsize
