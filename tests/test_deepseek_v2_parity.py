"""models/deepseek_v2 against transformers' DeepseekV2ForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered blocks of a NaN-filled latent cache; each prompt's
logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal transformers' for that prompt
alone. The configs cover V2-Lite's shape (no q LoRA, greedy routing, yarn with mscale_all_dim),
q LoRA with group-limited routing and biases, dense and MoE layers, and routing ties; the whole
engine runs with chunked prefill and a pool that preempts. Putting V3's sigmoid routing or plain
rope in place of V2's must break the parity, so the tests can tell the two families apart.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from models.deepseek_v2 import DeepseekV2ForCausalLM
from module.moe import SoftmaxGroupRouter, TopkRouter
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import deepseek_v2_config
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    max_prefill_diff,
    parity_models,
    random_prompts,
    save_random_model,
    single_thread,  # noqa: F401 (an autouse fixture)
)

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = PagedParityTests.tolerance

# DeepSeek-V2-Lite's yarn (its mscale == mscale_all_dim: cos/sin keep factor 1 and only the softmax
# scale takes mscale**2), its factor 40 over 4096 positions scaled down to this model's 128.
V2_LITE_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
}
GROUPED = {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}
# name -> (DeepseekV2Config overrides, KV block size)
CONFIGS = {
    "v2_lite_greedy_no_q_lora_yarn": ({"rope_parameters": V2_LITE_YARN}, 4),
    "q_lora_group_limited_biases_two_shared": (
        GROUPED | {"q_lora_rank": 48, "attention_bias": True, "n_shared_experts": 2},
        16,
    ),
    "tied_two_dense_layers_one_group_of_two": (
        {
            "tie_word_embeddings": True,
            "first_k_dense_replace": 2,
            "num_hidden_layers": 4,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
        },
        8,
    ),
}


def save_checkpoint(path: Path, config: transformers.DeepseekV2Config, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` with DeepSeek's tensor names, and transformers' model with its
    weights: random, the linear biases and norm weights (zeros and ones from transformers) drawn too."""
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1)}
    return save_random_model(path, transformers.DeepseekV2ForCausalLM, config, seed, redraw=redraw)


def load_ours(path: Path, config: transformers.DeepseekV2Config) -> DeepseekV2ForCausalLM:
    return paged_harness.load_ours(DeepseekV2ForCausalLM, path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, deepseek_v2_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Every family's parity tests (prefill, cached prefix, padded batched decode) on each of CONFIGS."""


@pytest.fixture(params=["greedy", "group_limited_greedy"], scope="module")
def tied_routing_models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    """Layer 1's router weights zero: every expert scores 1/8, so the experts tie for the top_k places
    (and, group-limited, the groups for the topk_group ones), and only top-k's tie-breaking chooses."""
    config = deepseek_v2_config(num_hidden_layers=2, **(GROUPED | {"topk_method": request.param}))
    path = tmp_path_factory.mktemp(f"tied_routing_{request.param}")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        hf_model.model.layers[1].mlp.gate.weight.zero_()
    hf_model.save_pretrained(path)  # the same checkpoint with the tied router
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


class TestRoutingTies(RoutingTieTests):
    """Every expert tied in layer 1 (tied_routing_models), under both topk_methods."""


def v3_routing(model: DeepseekV2ForCausalLM) -> None:
    """Each router swapped for V3's (sigmoid scores, zero score-correction bias) on the same weights."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, SoftmaxGroupRouter):
            num_experts, hidden_size = gate.weight.shape
            v3 = TopkRouter(
                hidden_size,
                num_experts,
                gate.top_k,
                gate.num_groups,
                gate.topk_group,
                False,
                gate.routed_scaling_factor,
            )
            v3.weight.copy_(gate.weight)
            v3.e_score_correction_bias.zero_()
            layer.mlp.gate = v3


def plain_rope(model: DeepseekV2ForCausalLM) -> None:
    """Rotate-half rope on the dims as stored, as V3 does with rope_interleave false."""
    for layer in model.model.layers:
        layer.self_attn.rope_interleave = False


@pytest.mark.parametrize("mutation", [v3_routing, plain_rope])
@pytest.mark.parametrize("config", ["v2_lite_greedy_no_q_lora_yarn", "q_lora_group_limited_biases_two_shared"])
def test_a_v3_mechanism_in_place_of_v2s_breaks_the_parity(
    config: str, mutation: Callable[[DeepseekV2ForCausalLM], None], tmp_path
):
    overrides, block_size = CONFIGS[config]
    hf_model, ours = parity_models(tmp_path, deepseek_v2_config(**overrides), save_checkpoint, load_ours, block_size)
    prompts = random_prompts(PagedParityTests.prefill_prompt_lens, seed=1)
    assert max_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    mutation(ours.model)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"topk_method": "noaux_tc"}, "config topk_method 'noaux_tc'"),
        ({"scoring_func": "sigmoid"}, "config scoring_func 'sigmoid'"),
        ({"norm_topk_prob": True}, "config norm_topk_prob True"),
        ({"moe_layer_freq": 2}, "config moe_layer_freq 2"),
        ({"mlp_bias": True}, "config mlp_bias True"),
    ],
)
def test_a_config_transformers_builds_otherwise_than_deepseek_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV2ForCausalLM(deepseek_v2_config(**overrides), backend=cpu_backend())


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint, found by
    cann-recipes' name, with prefill chunks of at most 16 tokens and 9 usable blocks of 16 tokens
    for a batch whose requests need 3 to 5 each: chunked prompts and preempted requests."""
    config = deepseek_v2_config(**ENGINE_CONFIG)
    path = tmp_path_factory.mktemp("tiny_deepseek_v2")
    hf_model = save_checkpoint(path, config)
    run = generate_random_prompts(path, "deepseek_v2_lite", max_prefill_tokens=16, num_blocks=10, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, DeepseekV2ForCausalLM)
