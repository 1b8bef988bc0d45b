"""models/hy3 against transformers' HYV3ForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered blocks of a NaN-filled KV cache; each prompt's logits
(fp32, max-abs-diff <= 1e-4) and greedy tokens must equal transformers' for that prompt alone. The
configs cover dense and sparse layers by mlp_layer_types, a drawn router bias, q/k norms, and
attention and MLP biases with two shared experts; routing ties (every expert tied, and two tied at
the top-k cut) break as transformers breaks them; the whole engine runs with chunked prefill and a
pool that preempts. Breaking each Hy3 mechanism (the router's bias, renormalisation or scale, the
shared experts, the q/k norms, the layer types) must break the parity.
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
from models.hy3 import Hy3ForCausalLM
from models.hy3.model import Hy3MoE
from module.moe import SigmoidTopkRouter, chosen_weights
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import hy3_config
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
CANN_HY3_KEYS = ROOT / "tests" / "data" / "cann_recipes" / "hy3.yaml"
CANN_HY3_RUN = ROOT / "tests" / "data" / "cann_recipes" / "runs" / "hy3.yaml"
TOLERANCE = PagedParityTests.tolerance

# name -> (HYV3Config overrides, KV block size)
CONFIGS = {
    "first_layer_dense_top2": ({}, 4),
    "biases_two_shared_sparse_dense_sparse_top3": (
        {
            "attention_bias": True,
            "mlp_bias": True,
            "num_shared_experts": 2,
            "num_experts_per_tok": 3,
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        16,
    ),
}


def save_checkpoint(path: Path, config: transformers.HYV3Config, seed: int = 0) -> torch.nn.Module:
    """transformers' model for `config` with random weights, saved to `path` (in Hy3's checkpoint names):
    the biases, norm weights and router bias (constants from transformers) drawn too, the router bias
    wide enough to change which experts win."""
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1), "e_score_correction_bias": (0.0, 0.05)}
    return save_random_model(path, transformers.HYV3ForCausalLM, config, seed, redraw=redraw)


def load_ours(path: Path, config: transformers.HYV3Config) -> Hy3ForCausalLM:
    return paged_harness.load_ours(Hy3ForCausalLM, path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, hy3_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Every family's parity tests (prefill, cached prefix, padded batched decode) on each of CONFIGS."""


def moe_blocks(model: Hy3ForCausalLM) -> list[Hy3MoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, Hy3MoE)]


# Layer 1's router bias when its router weights are zero (every score sigmoid(0) = 1/2): all eight
# experts tied, or expert 0 ahead and experts 2 and 5 tied for the second of top 2.
TIED_BIASES = {
    "every_expert_tied": [0.0] * 8,
    "two_experts_tied_at_the_cut": [1.0, 0.0, 0.5, 0.0, 0.0, 0.5, 0.0, 0.0],
}


@pytest.fixture(params=list(TIED_BIASES), scope="module")
def tied_checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path, transformers.HYV3Config]:
    """(transformers' model, its folder, its config) with layer 1's router tied as TIED_BIASES says."""
    config = hy3_config()
    path = tmp_path_factory.mktemp(f"tied_routing_{request.param}")
    hf_model = save_checkpoint(path, config)
    moe = hf_model.model.layers[1].mlp
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.e_score_correction_bias.copy_(torch.tensor(TIED_BIASES[request.param]))
    hf_model.save_pretrained(path)  # the same checkpoint with the tied router
    return hf_model, path, config


@pytest.fixture(scope="module")
def tied_routing_models(tied_checkpoint) -> tuple[torch.nn.Module, PagedModel]:
    hf_model, path, config = tied_checkpoint
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


class TestRoutingTies(RoutingTieTests):
    """Experts tied in layer 1 (tied_checkpoint)."""


def test_the_tie_config_puts_equal_choice_scores_at_the_top_k_cut(tied_checkpoint):
    """transformers' own router, on layer 1's tie: equal scores straddle the cut, so which expert
    wins is the top-k's tie-break."""
    hf_model, _, _ = tied_checkpoint
    moe = hf_model.model.layers[1].mlp
    scores = torch.sigmoid(torch.zeros(1, 8)) + moe.e_score_correction_bias
    kept = torch.topk(scores, moe.top_k, dim=-1).values[0, -1]
    assert (scores[0] == kept).sum() > 1


class HighestIdWinsRouter(SigmoidTopkRouter):
    """The same scores and weights, a tie won by the highest expert id, where transformers' unsorted
    top-k takes experts 6 and 5 of eight tied ones, and 2 over 5 at the cut."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(hidden_states.float(), self.weight))
        choice = (scores + self.e_score_correction_bias).flip(-1)
        reversed_ids = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, : self.top_k]
        topk_ids = scores.shape[-1] - 1 - reversed_ids
        return chosen_weights(scores, topk_ids, True, self.routed_scaling_factor), topk_ids


def test_ties_broken_otherwise_than_transformers_break_the_parity(tied_checkpoint):
    hf_model, path, config = tied_checkpoint
    ours = PagedModel(load_ours(path, config), block_size=4)
    for moe in moe_blocks(ours.model):
        moe.gate.__class__ = HighestIdWinsRouter
    prompts = random_prompts(RoutingTieTests.tie_prompt_lens, seed=4)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


class UnscaledRouter(SigmoidTopkRouter):
    """Renormalised weights without router_scaling_factor."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().forward(hidden_states)
        return weights / self.routed_scaling_factor, ids


class UnnormalisedRouter(SigmoidTopkRouter):
    """The chosen sigmoid scores, scaled but not renormalised."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, ids = super().forward(hidden_states)
        scores = torch.sigmoid(F.linear(hidden_states.float(), self.weight))
        return chosen_weights(scores, ids, False, self.routed_scaling_factor), ids


def router_class(cls: type[SigmoidTopkRouter]) -> Callable[[Hy3ForCausalLM], None]:
    def mutate(model: Hy3ForCausalLM) -> None:
        for moe in moe_blocks(model):
            moe.gate.__class__ = cls

    mutate.__name__ = f"router_{cls.__name__}"
    return mutate


def router_bias_ignored(model: Hy3ForCausalLM) -> None:
    """Experts chosen by their scores alone."""
    for moe in moe_blocks(model):
        moe.gate.e_score_correction_bias.zero_()


def no_shared_experts(model: Hy3ForCausalLM) -> None:
    for moe in moe_blocks(model):
        moe.shared_experts = None


def no_qk_norms(model: Hy3ForCausalLM) -> None:
    """q and k into rope as projected (Llama's attention)."""
    for layer in model.model.layers:
        layer.self_attn.project_qkv = types.MethodType(
            super(type(layer.self_attn).__mro__[1], layer.self_attn).project_qkv.__func__, layer.self_attn
        )


def routed_experts_in_the_dense_layer(model: Hy3ForCausalLM) -> None:
    """Layer 0 (dense in transformers' default mlp_layer_types) runs layer 1's MoE block instead."""
    model.model.layers[0].mlp = model.model.layers[1].mlp


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path, transformers.HYV3Config]:
    """(transformers' model, its folder, its config) for the first of CONFIGS."""
    config = hy3_config(**CONFIGS["first_layer_dense_top2"][0])
    path = tmp_path_factory.mktemp("base")
    return save_checkpoint(path, config), path, config


@pytest.mark.parametrize(
    "mutation",
    [
        router_bias_ignored,
        router_class(UnscaledRouter),
        router_class(UnnormalisedRouter),
        no_shared_experts,
        no_qk_norms,
        routed_experts_in_the_dense_layer,
    ],
    ids=lambda mutation: mutation.__name__,
)
def test_breaking_a_hy3_mechanism_breaks_the_parity(mutation: Callable[[Hy3ForCausalLM], None], base_checkpoint):
    hf_model, path, config = base_checkpoint
    prompts = random_prompts(PagedParityTests.prefill_prompt_lens, seed=1)
    ours = PagedModel(load_ours(path, config), block_size=4)
    assert max_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    with torch.no_grad():
        mutation(ours.model)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


def test_a_bf16_add_is_the_fp32_combine_of_enable_moe_fp32_combine():
    """Why Hy3MoE adds its routed and shared outputs plainly: torch adds two bf16 tensors in fp32
    and rounds once, as transformers' fp32 combine does, over magnitudes far apart too."""
    generator = torch.Generator().manual_seed(0)
    routed, shared = (torch.randn(4096, generator=generator) * torch.logspace(-6, 6, 4096) for _ in range(2))
    routed, shared = routed.bfloat16(), shared.bfloat16()
    assert torch.equal(routed + shared, (routed.float() + shared.float()).to(torch.bfloat16))


def test_the_layers_are_sparse_where_mlp_layer_types_says(base_checkpoint):
    _, _, config = base_checkpoint
    overrides = CONFIGS["biases_two_shared_sparse_dense_sparse_top3"][0]
    model = Hy3ForCausalLM(hy3_config(**overrides), backend=cpu_backend())
    assert [isinstance(layer.mlp, Hy3MoE) for layer in model.model.layers] == [True, False, True]
    assert model.model.layers[1].mlp.gate_up_proj.bias is not None  # mlp_bias on the dense MLP too


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "config mlp_layer_types"),
        ({"num_shared_experts": 0}, "config num_shared_experts 0"),
        ({"mlp_layer_types": ["sparse", "sparse", "dense"], "num_nextn_predict_layers": 1}, "MTP layer is sparse"),
    ],
)
def test_a_config_hy3_does_not_build_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        Hy3ForCausalLM(hy3_config(**overrides), backend=cpu_backend())


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine on a saved tiny checkpoint, found by cann-recipes' name, with prefill chunks
    of at most 16 tokens and 9 usable blocks of 16 tokens for a batch whose requests need 3 to 5
    each: chunked prompts and preempted requests."""
    config = hy3_config(**ENGINE_CONFIG)
    path = tmp_path_factory.mktemp("tiny_hy3")
    hf_model = save_checkpoint(path, config)
    run = generate_random_prompts(path, "hy3", max_prefill_tokens=16, num_blocks=10, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, Hy3ForCausalLM)


def test_the_cann_recipes_hy3_key_file_validates_and_finds_the_folder():
    """tests/data/cann_recipes/hy3.yaml (cann-recipes' keys at their released values: 16 ranks, a
    checkpoint that is not here) loads with no unknown key and names this folder."""
    config = load_config(CANN_HY3_KEYS)
    assert model_folder(config.model_config.model_name) == "hy3"
    assert config.model_config.next_n == 2


def test_a_cann_recipes_hy3_yaml_validates_finds_the_folder_and_runs(tmp_path, monkeypatch):
    """tests/data/cann_recipes/runs/hy3.yaml: cann-recipes' keys, no unknown one, the folder found by
    model_name, random weights end to end, drafting with the MTP module (next_n 1)."""
    monkeypatch.chdir(ROOT)  # its model_path is relative, as cann-recipes' are to where one runs
    config = load_config(CANN_HY3_RUN)
    assert model_folder(config.model_config.model_name) == "hy3"
    out = tmp_path / "out"
    settings = [
        f"model_config.output_path={out}",
        "model_config.device=cpu",
        "scheduler_config.batch_size_meaning=num_requests",  # cann-recipes' batch_size: 4 requests
        "data_config.apply_chat_template=false",  # the tiny tokenizer has no chat template
    ]
    assert offline_main(["--yaml", str(CANN_HY3_RUN), *(arg for s in settings for arg in ("--set", s))]) == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 6 for line in lines)
    assert "hy3 main and mtp model average inference time cost is " in (out / "steps.log").read_text()
