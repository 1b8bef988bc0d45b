"""models/longcat_flash against transformers' LongcatFlashForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered blocks of a NaN-filled latent cache (two MLA blocks per
layer, each with its own cache); each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy
tokens must equal transformers' for that prompt alone. The configs cover zero-computation experts
among the routed ones with a drawn score-correction bias, attention biases with yarn rope, and
routing ties (every expert tied, and zero experts tied with routed ones at the top-k cut); the
whole engine runs with chunked prefill and a pool that preempts. Breaking each mechanism (zero
experts that compute or give nothing, no shortcut MoE, no LoRA scaling, a router that ignores its
bias) must break the parity.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from executor.core.config import load_config
from executor.core.config.model_registry import model_folder
from executor.offline.__main__ import main as offline_main
from models.longcat_flash import LongcatFlashForCausalLM
from models.longcat_flash.model import LongcatFlashMoE, LongcatFlashRouter
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import longcat_flash_config
from tests.longcat_flash_harness import load_ours, save_checkpoint
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    check_decode_traces_as_one_graph,
    max_prefill_diff,
    parity_models,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)

ROOT = Path(__file__).resolve().parents[1]
CANN_LONGCAT = ROOT / "tests" / "data" / "cann_recipes" / "runs" / "longcat_flash.yaml"
TOLERANCE = PagedParityTests.tolerance

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000000.0,
}
# name -> (LongcatFlashConfig overrides, KV block size)
CONFIGS = {
    "four_zero_experts_of_twelve": ({}, 4),
    "attention_bias_yarn_eight_zero_experts_top4": (
        {"attention_bias": True, "rope_parameters": YARN, "zero_expert_num": 8, "moe_topk": 4},
        16,
    ),
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, longcat_flash_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Every family's parity tests (prefill, cached prefix, padded batched decode) on each of CONFIGS."""


def moe_blocks(model: LongcatFlashForCausalLM) -> list[LongcatFlashMoE]:
    return [layer.mlp for layer in model.model.layers]


# Layer 1's score-correction bias when its router weights are zero (every score 1/12): all experts
# tied, or routed experts 0 and 1 ahead and routed expert 2 tied with zero expert 8 for the third
# place (ties among zero experts alone cannot show: each passes the token on).
TIED_BIASES = {
    "every_expert_tied": [0.0] * 12,
    "a_zero_expert_tied_with_a_routed_one_at_the_cut": [1.0, 1.0, 0.5, 0, 0, 0, 0, 0, 0.5, 0, 0, 0],
}


@pytest.fixture(params=list(TIED_BIASES), scope="module")
def tied_checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path, transformers.LongcatFlashConfig]:
    """(transformers' model, its folder, its config) with layer 1's router tied as TIED_BIASES says."""
    config = longcat_flash_config()
    path = tmp_path_factory.mktemp(f"tied_routing_{request.param}")
    hf_model = save_checkpoint(path, config)
    router = hf_model.model.layers[1].mlp.router
    with torch.no_grad():
        router.classifier.weight.zero_()
        router.e_score_correction_bias.copy_(torch.tensor(TIED_BIASES[request.param]))
    hf_model.save_pretrained(path)  # the same checkpoint with the tied router
    return hf_model, path, config


@pytest.fixture(scope="module")
def tied_routing_models(tied_checkpoint) -> tuple[torch.nn.Module, PagedModel]:
    hf_model, path, config = tied_checkpoint
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


class TestRoutingTies(RoutingTieTests):
    """Experts tied in layer 1 (tied_checkpoint), zero-computation experts among them."""


class LowestIdWinsRouter(LongcatFlashRouter):
    """The same scores and weights, a tie won by the lowest expert id (a stable sort), where
    transformers' unsorted top-k takes ids 7-9 of twelve tied experts and zero expert 8 over routed 2."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden_states.float(), self.weight).softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.unsqueeze(0)
        topk_ids = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, : self.top_k]
        return scores.gather(1, topk_ids) * self.routed_scaling_factor, topk_ids


def test_ties_broken_otherwise_than_transformers_break_the_parity(tied_checkpoint):
    hf_model, path, config = tied_checkpoint
    ours = PagedModel(load_ours(path, config), block_size=4)
    for moe in moe_blocks(ours.model):
        moe.gate.__class__ = LowestIdWinsRouter
    prompts = random_prompts(RoutingTieTests.tie_prompt_lens, seed=4)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


def zero_experts_compute(model: LongcatFlashForCausalLM) -> None:
    """Slots routed to zero experts run routed expert (id mod n_routed) instead of passing the token on."""

    def forward(self: LongcatFlashMoE, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden_states)
        return self.experts(hidden_states, topk_weights, topk_ids % self.experts.num_experts)

    for moe in moe_blocks(model):
        moe.forward = types.MethodType(forward, moe)


def zero_experts_give_nothing(model: LongcatFlashForCausalLM) -> None:
    """Slots routed to zero experts add nothing (a zero output rather than the token itself)."""

    def forward(self: LongcatFlashMoE, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden_states)
        is_zero = topk_ids >= self.experts.num_experts
        return self.experts(hidden_states, topk_weights.masked_fill(is_zero, 0), topk_ids.masked_fill(is_zero, 0))

    for moe in moe_blocks(model):
        moe.forward = types.MethodType(forward, moe)


def no_shortcut(model: LongcatFlashForCausalLM) -> None:
    """The MoE's output never joins the residual stream."""
    for moe in moe_blocks(model):
        moe.forward = types.MethodType(lambda self, hidden_states: torch.zeros_like(hidden_states), moe)


def no_lora_scaling(model: LongcatFlashForCausalLM) -> None:
    """MLA as DeepSeek's: query and latent unscaled."""
    for layer in model.model.layers:
        for attention in layer.self_attn:
            attention.q_lora_scale = attention.kv_lora_scale = 1.0


def router_bias_ignored(model: LongcatFlashForCausalLM) -> None:
    """Experts chosen by their scores alone."""
    for moe in moe_blocks(model):
        moe.gate.e_score_correction_bias.zero_()


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path, transformers.LongcatFlashConfig]:
    """(transformers' model, its folder, its config) for the first of CONFIGS."""
    config = longcat_flash_config(**CONFIGS["four_zero_experts_of_twelve"][0])
    path = tmp_path_factory.mktemp("base")
    return save_checkpoint(path, config), path, config


@pytest.mark.parametrize(
    "mutation", [zero_experts_compute, zero_experts_give_nothing, no_shortcut, no_lora_scaling, router_bias_ignored]
)
def test_breaking_a_longcat_mechanism_breaks_the_parity(
    mutation: Callable[[LongcatFlashForCausalLM], None], base_checkpoint
):
    hf_model, path, config = base_checkpoint
    prompts = random_prompts(PagedParityTests.prefill_prompt_lens, seed=1)
    ours = PagedModel(load_ours(path, config), block_size=4)
    assert max_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    with torch.no_grad():
        mutation(ours.model)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


def test_a_decode_step_traces_as_one_graph(base_checkpoint):
    _, path, config = base_checkpoint
    check_decode_traces_as_one_graph(PagedModel(load_ours(path, config), 4), random_prompts([3, 9, 5], seed=8))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router_bias": True}, "config router_bias True"),
        ({"norm_topk_prob": True}, "config norm_topk_prob True"),
        ({"mla_scale_q_lora": False}, "config mla_scale_q_lora False"),
        ({"mla_scale_kv_lora": False}, "config mla_scale_kv_lora False"),
        ({"zero_expert_type": "zero"}, "config zero_expert_type 'zero'"),
        ({"head_dim": 16}, r"config head_dim \(the rope's dims\) 16"),
        ({"qk_head_dim": 32}, "config qk_head_dim 32"),
    ],
)
def test_a_config_transformers_builds_otherwise_than_longcat_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        LongcatFlashForCausalLM(longcat_flash_config(**overrides), backend=cpu_backend())


def test_the_zero_experts_gate_up_tensors_transformers_saves_are_skipped(base_checkpoint):
    """transformers' stacked gate_up_proj has a slot per expert, zero experts included; LongCat's
    checkpoints have no such tensors, and ours has no parameter for them. MTP tensors are skipped
    when the config has no MTP module."""
    _, path, config = base_checkpoint
    ours = load_ours(path, config)  # every parameter filled, no unexpected tensor
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape[0] == config.n_routed_experts
    assert ours._is_skipped("model.layers.0.mlp.experts.8.gate_proj.weight")
    assert ours._is_skipped("model.mtp.layers.0.eh_proj.weight")
    assert not ours._is_skipped("model.layers.0.mlp.experts.7.gate_proj.weight")


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint, found by
    cann-recipes' name, with prefill chunks of at most 16 tokens and 9 usable blocks of 16 tokens
    for a batch whose requests need 3 to 5 each: chunked prompts and preempted requests."""
    config = longcat_flash_config(**ENGINE_CONFIG)
    path = tmp_path_factory.mktemp("tiny_longcat_flash")
    hf_model = save_checkpoint(path, config)
    run = generate_random_prompts(path, "longcat_flash", max_prefill_tokens=16, num_blocks=10, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, LongcatFlashForCausalLM)


def test_a_cann_recipes_longcat_flash_yaml_validates_finds_the_folder_and_runs(tmp_path, monkeypatch):
    """tests/data/cann_recipes/runs/longcat_flash.yaml: cann-recipes' keys, no unknown one, the folder
    found by model_name, random weights end to end, drafting with the MTP module (next_n 1)."""
    monkeypatch.chdir(ROOT)  # its model_path is relative, as cann-recipes' are to where one runs
    config = load_config(CANN_LONGCAT)
    assert model_folder(config.model_config.model_name) == "longcat_flash"
    out = tmp_path / "out"
    settings = [
        f"model_config.output_path={out}",
        "model_config.device=cpu",
        "scheduler_config.batch_size_meaning=num_requests",  # cann-recipes' batch_size: 4 requests
        "data_config.apply_chat_template=false",  # the tiny tokenizer has no chat template
    ]
    assert offline_main(["--yaml", str(CANN_LONGCAT), *(arg for s in settings for arg in ("--set", s))]) == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 6 for line in lines)
    assert "longcat_flash main and mtp model average inference time cost is " in (out / "steps.log").read_text()
