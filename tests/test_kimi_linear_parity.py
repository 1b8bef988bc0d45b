"""models/kimi_linear against transformers' KimiLinearForCausalLM with the same weights, on the paged path.

Prompts run packed together: the MLA layers over scattered blocks of a NaN-filled latent cache, the
KDA layers over NaN-filled state slots; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy
tokens must equal transformers' for that prompt alone, a prompt prefilled in two chunks too (the
states carried from the first chunk). The whole engine runs with chunked prefill and a pool that
preempts. Dropping the state carry, the decay or the delta rule's beta must break the parity.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from executor.core.config import ConfigError
from executor.core.config.model_registry import check_model_name
from models.kimi_linear import KimiLinearForCausalLM
from ops import recurrent_ref
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import kimi_linear_config
from tests.kda_harness import (
    KDA_MUTATIONS,
    make_looping,
    ngram_outputs,
    split_prefill_diff,
)
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    check_decode_traces_as_one_graph,
    parity_models,
    random_prompts,
    save_random_model,
    single_thread,  # noqa: F401 (an autouse fixture)
)

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = PagedParityTests.tolerance
# name -> (KimiLinearConfig overrides, KV block size)
CONFIGS = {
    "kimi_48b_routing_one_group": ({}, 4),
    "grouped_routing_q_lora_two_dense_layers": (
        {"n_group": 4, "topk_group": 2, "q_lora_rank": 48, "first_k_dense_replace": 2, "linear_conv_kernel_dim": 3},
        16,
    ),
}


def save_checkpoint(path: Path, config: transformers.KimiLinearConfig, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` with Moonshot's tensor names, and transformers' model with its
    weights: random, the biases (the router's correction, dt_bias) and norm weights drawn too."""
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1)}
    return save_random_model(path, transformers.KimiLinearForCausalLM, config, seed, redraw=redraw)


def load_ours(path: Path, config: transformers.KimiLinearConfig) -> KimiLinearForCausalLM:
    return paged_harness.load_ours(KimiLinearForCausalLM, path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, kimi_linear_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Every family's parity tests (prefill, a prompt in two chunks, padded batched decode) on each of CONFIGS."""


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    """Layer 1's router weights and correction bias zero: every expert scores sigmoid(0), so only
    top-k's tie-breaking chooses."""
    config = kimi_linear_config(n_group=4, topk_group=2)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        hf_model.model.layers[1].mlp.gate.weight.zero_()
        hf_model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    hf_model.save_pretrained(path)
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


class TestRoutingTies(RoutingTieTests):
    """Every expert tied in layer 1 (tied_routing_models)."""


@pytest.mark.parametrize("mutation", KDA_MUTATIONS)
def test_dropping_a_kda_mechanism_breaks_the_parity(mutation: Callable[[torch.nn.Module], None], tmp_path):
    hf_model, ours = parity_models(tmp_path, kimi_linear_config(), save_checkpoint, load_ours, 4)
    prompts = random_prompts((9, 14, 20), seed=1)
    assert split_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    mutation(ours.model)
    assert split_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


def test_an_unknown_layer_type_is_refused():
    config = kimi_linear_config()
    config.layer_types = ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"config layer_types holds \['sliding_attention'\]"):
        KimiLinearForCausalLM(config, backend=cpu_backend())


def test_cann_recipes_kimi_k3_is_refused_as_another_architecture():
    """cann-recipes' kimi_k3 (our copy of its flattened-schema file) names Kimi K3, not Kimi-Linear."""
    raw = yaml.safe_load((ROOT / "tests" / "data" / "cann_recipes_flat" / "kimi_k3.yaml").read_text())
    with pytest.raises(ConfigError, match="not built here: Kimi K3 adds block attention residuals"):
        check_model_name(raw["model_name"], "kimi_k3.yaml")


@pytest.fixture(scope="module")
def engine_checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A saved tiny checkpoint with the tiny tokenizer's special tokens, and transformers' model."""
    path = tmp_path_factory.mktemp("tiny_kimi_linear")
    return save_checkpoint(path, kimi_linear_config(**ENGINE_CONFIG)), path


@pytest.fixture(scope="module")
def engine_run(engine_checkpoint):
    """The whole engine on the checkpoint, found by its folder's name, with prefill chunks of at most
    16 tokens (inside the longer prompts) and 9 usable blocks of 16 tokens for a batch whose requests
    need 3 to 5 each: chunked prompts carry their states, preempted requests recompute."""
    hf_model, path = engine_checkpoint
    run = generate_random_prompts(path, "kimi_linear", max_prefill_tokens=16, num_blocks=10, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, KimiLinearForCausalLM)


@pytest.fixture(scope="module")
def looping_checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("looping_kimi_linear")
    hf_model = save_checkpoint(path, kimi_linear_config(**ENGINE_CONFIG))
    make_looping(hf_model, path)
    return hf_model, path


def test_ngram_speculation_keeps_each_positions_state_and_gives_greedy_output(looping_checkpoint):
    """Verify steps of 1 + 3 tokens keep KDA's state after each position in the request's ring of
    slots; the next step reads the accepted prefix's: drafts accepted and rejected, greedy output."""
    stats, outputs, expected = ngram_outputs(*looping_checkpoint, "kimi_linear")
    assert stats["draft_tokens"] > 0 and 0 < stats["accept_rate"] < 1
    assert outputs == expected


def test_speculation_is_wrong_without_kdas_states_kept_per_position(looping_checkpoint, monkeypatch):
    """The mutation: KDA's verify rows keep only the state after their last draft, accepted or not."""
    monkeypatch.setattr(recurrent_ref, "_position_slots", lambda tables, num_rows: [None] * num_rows)
    _, outputs, expected = ngram_outputs(*looping_checkpoint, "kimi_linear")
    assert outputs != expected


@pytest.mark.slow
@pytest.mark.parametrize("models", [name for name in CONFIGS if name != "kimi_48b_routing_one_group"], indirect=True)
def test_a_decode_step_traces_as_one_graph_equal_to_eager(models):
    """What ge_graph compiles (fullgraph, static shapes): a padded decode step over the state slots.
    Not on kimi_48b_routing_one_group, the tiny YAML's structure, which tests/test_tiny_configs.py
    compiles in ge_graph through the engine (inductor, fullgraph) against eager's tokens."""
    _, ours = models
    check_decode_traces_as_one_graph(ours, random_prompts((5, 9, 3), seed=6))
