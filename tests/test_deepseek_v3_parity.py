"""models/deepseek_v3 against transformers' DeepseekV3ForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered blocks of a NaN-filled latent cache; each prompt's
logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal transformers' for that prompt
alone. Prefill takes the naive MLA form, decode the absorbed one; the configs cover q_lora_rank set
and None, interleaved and plain rope, yarn scaling, dense and MoE layers, and routing ties.
"""

from __future__ import annotations

import pytest
import torch

from tests.deepseek_v3_harness import load_ours, save_checkpoint
from tests.engine_harness import ENGINE_CONFIG, check_engine_greedy, generate_random_prompts
from tests.factories import deepseek_config
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    parity_models,
    single_thread,  # noqa: F401 (an autouse fixture)
)

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


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, deepseek_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Packed prefill, prefill over a cached prefix, and batched greedy decoding with steps padded to
    8 rows (padding rows read and write only the null block), each against transformers."""


# Every router's logits are 0 (gate weights zero), so each expert's score is sigmoid(0) = 0.5 and
# only these score-correction biases (exact in binary) order them: groups {0,1}, {2,3}, {4,5} all
# score 1.375 (their two best biased scores summed) and tie for the topk_group=2 places; the kept
# groups' second experts then tie for the last of the top_k=3 places.
TIE_BIASES = torch.tensor([0.25, 0.125, 0.25, 0.125, 0.25, 0.125, 0.0, 0.0])
EXPERTS_PER_GROUP = 2


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
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


class TestRoutingTies(RoutingTieTests):
    """Groups and experts tied by TIE_BIASES, as the test above shows."""


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint with one MTP
    module, whose attention gets its latent cache like every other layer."""
    config = deepseek_config(num_nextn_predict_layers=1, **ENGINE_CONFIG)
    path = tmp_path_factory.mktemp("tiny_deepseek_v3")
    hf_model = save_checkpoint(path, config)
    return config, hf_model, *generate_random_prompts(path, "deepseek_v3")


def test_engine_greedy_equals_transformers_generate(engine_run):
    _, hf_model, _, prompts, result = engine_run
    check_engine_greedy(hf_model, prompts, result)


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
