"""models/bailing_hybrid against transformers' BailingHybridForCausalLM with the same weights, on the paged path.

Prompts run packed together: the MLA layers over scattered blocks of a NaN-filled latent cache, the
KDA layers over NaN-filled state slots; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy
tokens must equal transformers' for that prompt alone, a prompt prefilled in two chunks too (the
states carried from the first chunk). The whole engine runs with chunked prefill and a pool that
preempts. Dropping the state carry, the decay, the delta rule's beta, MLA's output gate or its
interleaved rope must break the parity.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
import yaml

from executor.core.config import ConfigError
from executor.core.config.model_registry import check_model_name
from models.bailing_hybrid import BailingHybridForCausalLM
from models.bailing_hybrid.model import BailingHybridMLA
from ops import recurrent_ref
from tests import paged_harness
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import bailing_hybrid_config
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
# name -> (BailingHybridConfig overrides, KV block size)
CONFIGS = {
    "ling3_bounded_gate": ({}, 4),
    "softplus_gate_q_lora_two_dense_layers_tied": (
        {"kda_safe_gate": False, "q_lora_rank": 48, "first_k_dense_replace": 2, "tie_word_embeddings": True},
        16,
    ),
    "mla_every_third_layer_conv_3": ({"layer_group_size": 3, "short_conv_kernel_size": 3, "num_hidden_layers": 3}, 8),
}


def save_checkpoint(path: Path, config: transformers.BailingHybridConfig, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` with inclusionAI's tensor names, and transformers' model with its
    weights: random, the biases (the router's correction, dt_bias) and norm weights drawn too."""
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1)}
    return save_random_model(path, transformers.BailingHybridForCausalLM, config, seed, redraw=redraw)


def load_ours(path: Path, config: transformers.BailingHybridConfig) -> BailingHybridForCausalLM:
    return paged_harness.load_ours(BailingHybridForCausalLM, path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, bailing_hybrid_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Every family's parity tests (prefill, a prompt in two chunks, padded batched decode) on each of CONFIGS."""


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    """Layer 1's router weights and correction bias zero: every expert scores sigmoid(0), so only
    top-k's tie-breaking chooses."""
    config = bailing_hybrid_config()
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        hf_model.model.layers[1].mlp.gate.weight.zero_()
        hf_model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    hf_model.save_pretrained(path)
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


class TestRoutingTies(RoutingTieTests):
    """Every expert tied in layer 1 (tied_routing_models)."""


def no_mla_output_gate(model: torch.nn.Module) -> None:
    for layer in model.modules():
        if isinstance(layer, BailingHybridMLA):
            layer.gate_output = lambda output, hidden_states: output


def plain_rope(model: torch.nn.Module) -> None:
    """Rotate-half rope on the dims as stored, not on interleaved pairs."""
    for layer in model.modules():
        if isinstance(layer, BailingHybridMLA):
            layer.rope_interleave = False


@pytest.mark.parametrize("mutation", [*KDA_MUTATIONS, no_mla_output_gate, plain_rope])
def test_dropping_a_mechanism_breaks_the_parity(mutation: Callable[[torch.nn.Module], None], tmp_path):
    hf_model, ours = parity_models(tmp_path, bailing_hybrid_config(), save_checkpoint, load_ours, 4)
    prompts = random_prompts((9, 14, 20), seed=1)
    assert split_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    mutation(ours.model)
    assert split_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


def test_the_mtp_layers_after_the_decoder_are_skipped_as_transformers_skips_them(tmp_path):
    """A checkpoint with one MTP layer (model.layers.4.*) loads into the 4-layer model, and transformers
    ignores the same tensors: the logits agree."""
    config = bailing_hybrid_config(num_mtp_layers=1)
    hf_model = save_checkpoint(tmp_path, config)
    mtp = {f"model.layers.4.{name}": tensor for name, tensor in hf_model.model.layers[3].state_dict().items()}
    safetensors.torch.save_file(mtp, tmp_path / "mtp.safetensors")
    ours = PagedModel(load_ours(tmp_path, config), block_size=4)
    assert split_prefill_diff(hf_model, ours, random_prompts((9, 12), seed=2)) <= TOLERANCE


def test_cann_recipes_bailing_2_5_is_refused_as_another_architecture():
    """cann-recipes' bailing_2_5 (our copy of its file) names Ling 2.5, not Ling 3."""
    raw = yaml.safe_load((ROOT / "tests" / "data" / "cann_recipes" / "bailing_2_5.yaml").read_text())
    with pytest.raises(ConfigError, match=r"not built here: Bailing 2.5 \(Ling 2.5, BailingMoeV2_5\)"):
        check_model_name(raw["model_config"]["model_name"], "bailing_2_5.yaml")


@pytest.fixture(scope="module")
def engine_checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A saved tiny checkpoint with the tiny tokenizer's special tokens, and transformers' model."""
    path = tmp_path_factory.mktemp("tiny_bailing_hybrid")
    return save_checkpoint(path, bailing_hybrid_config(**ENGINE_CONFIG)), path


@pytest.fixture(scope="module")
def engine_run(engine_checkpoint):
    """The whole engine on the checkpoint, found by its folder's name, with prefill chunks of at most
    16 tokens (inside the longer prompts) and 9 usable blocks of 16 tokens for a batch whose requests
    need 3 to 5 each: chunked prompts carry their states, preempted requests recompute."""
    hf_model, path = engine_checkpoint
    run = generate_random_prompts(path, "bailing_hybrid", max_prefill_tokens=16, num_blocks=10, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, BailingHybridForCausalLM)


@pytest.fixture(scope="module")
def looping_checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("looping_bailing_hybrid")
    hf_model = save_checkpoint(path, bailing_hybrid_config(**ENGINE_CONFIG))
    make_looping(hf_model, path)
    return hf_model, path


def test_ngram_speculation_keeps_each_positions_state_and_gives_greedy_output(looping_checkpoint):
    """Verify steps of 1 + 3 tokens keep KDA's state after each position in the request's ring of
    slots; the next step reads the accepted prefix's: drafts accepted and rejected, greedy output."""
    stats, outputs, expected = ngram_outputs(*looping_checkpoint, "bailing_hybrid")
    assert stats["draft_tokens"] > 0 and 0 < stats["accept_rate"] < 1
    assert outputs == expected


def test_speculation_is_wrong_without_kdas_states_kept_per_position(looping_checkpoint, monkeypatch):
    """The mutation: KDA's verify rows keep only the state after their last draft, accepted or not."""
    monkeypatch.setattr(recurrent_ref, "_position_slots", lambda tables, num_rows: [None] * num_rows)
    _, outputs, expected = ngram_outputs(*looping_checkpoint, "bailing_hybrid")
    assert outputs != expected


@pytest.mark.slow
@pytest.mark.parametrize("models", [name for name in CONFIGS if name != "ling3_bounded_gate"], indirect=True)
def test_a_decode_step_traces_as_one_graph_equal_to_eager(models):
    """What ge_graph compiles (fullgraph, static shapes): a padded decode step over the state slots.
    Not on ling3_bounded_gate, the tiny YAML's structure, which tests/test_tiny_configs.py compiles
    in ge_graph through the engine (inductor, fullgraph) against eager's tokens."""
    _, ours = models
    check_decode_traces_as_one_graph(ours, random_prompts((5, 9, 3), seed=6))
