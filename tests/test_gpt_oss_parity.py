"""models/gpt_oss against transformers' GptOssForCausalLM with the same weights, on the paged path.

Prompts longer than the sliding window run packed together over scattered blocks of NaN-filled
caches; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal
transformers' for that prompt alone. Every config mixes sliding and full layers and has nonzero
sinks and biases; they cover tied and untied embeddings, YaRN with and without `truncate`, GQA,
a clamp limit that the SwiGLU inputs pass, routing ties (duplicate router rows), and the whole
engine with one cache group per attention kind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from executor.model_loader.default_loader import safetensors_weights
from executor.types_ import AttentionKind
from executor.types_.errors import WeightLoadError
from models.gpt_oss import GptOssForCausalLM
from module.rotary import RotaryEmbedding
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import ENGINE_CONFIG, check_engine_greedy, generate_random_prompts
from tests.factories import GPT_OSS_WINDOW, gpt_oss_config, gpt_oss_yarn
from tests.npu_stand_ins import RecordingTorchNpu, npu_backend
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    check_decode_traces_as_one_graph,
    hf_last_logits,
    parity_models,
    random_prompts,
    save_random_model,
    single_thread,  # noqa: F401 (an autouse fixture)
)

TOLERANCE = 1e-4


def save_checkpoint(path: Path, config: transformers.GptOssConfig, seed: int = 0) -> transformers.GptOssForCausalLM:
    """transformers' model with random weights, biases (zero from transformers' init) and sinks of
    order one, saved to `path` in its own format; returned for reference."""
    redraw = {"bias": (0.0, 0.1), "sinks": (0.0, 1.0)}
    return save_random_model(path, transformers.GptOssForCausalLM, config, seed, redraw)


def load_ours(path: Path, config: transformers.GptOssConfig) -> GptOssForCausalLM:
    return paged_harness.load_ours(GptOssForCausalLM, path, config)


def test_yarn_truncate_changes_the_rope_frequencies_at_this_head_dim():
    """So that the two yarn configs below test two different tables."""
    untruncated = RotaryEmbedding(gpt_oss_config(), 16).cos_sin_cache
    truncated = RotaryEmbedding(gpt_oss_config(rope_parameters=gpt_oss_yarn(truncate=True)), 16).cos_sin_cache
    assert (untruncated - truncated).abs().max() > 0.1


# name -> (GptOssConfig overrides, KV block size)
CONFIGS = {
    "untied_yarn": ({}, 4),
    "tied_yarn_truncated_mha": (
        {"tie_word_embeddings": True, "rope_parameters": gpt_oss_yarn(truncate=True), "num_key_value_heads": 4},
        8,
    ),
    "clamped_three_of_eight_experts": (
        # SwiGLU inputs here are of order 0.3, so this limit clamps many of them.
        {"swiglu_limit": 0.2, "swiglu_alpha": 1.5, "num_local_experts": 8, "num_experts_per_tok": 3},
        16,
    ),
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[transformers.GptOssForCausalLM, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, gpt_oss_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Prompts and cached prefixes longer than the window (8), decoding past it with steps padded to 8 rows."""

    prefill_prompt_lens = (5, 17, 1, 9, 30)
    prefix_prompt_lens, prefix_splits = (21, 13), (12, 3)


def test_sinks_change_the_logits_far_beyond_the_tolerance(models):
    """So that the parity above could not hold with sinks ignored."""
    hf_model, _ = models
    prompt = random_prompts([12], seed=6)[0]
    with_sinks = hf_last_logits(hf_model, prompt)
    sinks = [layer.self_attn.sinks for layer in hf_model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    with torch.no_grad():
        for s in sinks:
            s.fill_(float("-inf"))  # exp(-inf) = 0: plain softmax
        without_sinks = hf_last_logits(hf_model, prompt)
        for s, value in zip(sinks, saved, strict=True):
            s.copy_(value)
    assert (with_sinks - without_sinks).abs().max() > 100 * TOLERANCE


# Router rows 0, 1 and 2 (and their biases) are equal, so every token's logits tie among those
# three experts and, with top_k 2, the cut falls inside the tie: one or two of them are chosen.
TIED_EXPERTS = [0, 1, 2]


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[transformers.GptOssForCausalLM, PagedModel]:
    config = gpt_oss_config(num_hidden_layers=2)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            router = layer.mlp.router
            router.weight[TIED_EXPERTS] = router.weight[0].clone()
            router.bias[TIED_EXPERTS] = router.bias[0].clone()
    hf_model.save_pretrained(path)  # the same checkpoint with the tied routers
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


def test_tied_router_rows_put_the_top_k_cut_inside_the_tie(tied_routing_models):
    hf_model, _ = tied_routing_models
    router = hf_model.model.layers[0].mlp.router
    logits, _, topk_ids = router(torch.randn(32, hf_model.config.hidden_size))
    assert (logits[:, TIED_EXPERTS] == logits[:, :1]).all()
    chosen_tied = torch.isin(topk_ids, torch.tensor(TIED_EXPERTS)).sum(-1)
    assert ((chosen_tied == 1) | (chosen_tied == 2)).all()  # never all three: the tie is broken every time


class TestRoutingTies(RoutingTieTests):
    """Experts tied by equal router rows (TIED_EXPERTS), as the test above shows."""


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint."""
    path = tmp_path_factory.mktemp("tiny_gpt_oss")
    hf_model = save_checkpoint(path, gpt_oss_config(**ENGINE_CONFIG))
    return hf_model, *generate_random_prompts(path, "gpt_oss")


def test_engine_greedy_equals_transformers_generate(engine_run):
    hf_model, _, prompts, result = engine_run
    check_engine_greedy(hf_model, prompts, result)


def test_sliding_and_full_layers_get_a_cache_group_each(engine_run):
    _, inference, _, _ = engine_run
    groups = inference.engine.worker.kv_cache_groups
    assert [g.spec.kind for g in groups] == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]
    assert [len(g.layer_names) for g in groups] == [2, 2] and groups[0].spec.sliding_window == GPT_OSS_WINDOW


def test_mxfp4_blocks_without_their_scales_are_refused_by_name(tmp_path):
    """MXFP4 experts load (tests/test_quantized_experts.py); half a pair is one line naming the other half."""
    config = gpt_oss_config(num_hidden_layers=2)
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    save_file({name: torch.zeros(4, 32, 2, 16, dtype=torch.uint8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"gate_up_proj_scales is missing \(its MXFP4 pair"):
        GptOssForCausalLM(config, backend=cpu_backend()).load_weights(safetensors_weights(tmp_path))


def test_model_refuses_a_backend_without_its_ops_at_construction(monkeypatch):
    backend = npu_backend(monkeypatch, "eager", RecordingTorchNpu())
    with pytest.raises(NotImplementedError, match="paged_attention_with_sinks.*npu backend does not have"):
        GptOssForCausalLM(gpt_oss_config(), backend=backend)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_nextn_predict_layers": 1}, "no MTP modules"),
        ({"layer_types": ["sliding_attention", "chunked_attention"], "num_hidden_layers": 2}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window None"),
    ],
)
def test_a_config_that_is_not_gpt_oss_as_built_here_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        GptOssForCausalLM(gpt_oss_config(**overrides), backend=cpu_backend())


def test_decode_forward_traces_as_one_graph_and_matches_eager(tmp_path):
    """What the graph modes need (fullgraph, static shapes): the experts' host read of their counts
    and the paged gathers with sinks stay inside opaque ops."""
    config = gpt_oss_config(num_hidden_layers=2)  # one sliding layer, one full
    save_checkpoint(tmp_path, config)
    ours = PagedModel(load_ours(tmp_path, config), block_size=4)
    check_decode_traces_as_one_graph(ours, random_prompts([3, 12, 5], seed=8))
