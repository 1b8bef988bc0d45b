"""models/gemma_4 against transformers' Gemma4ForCausalLM with the same weights, on the paged path.

Prompts longer than the sliding window run packed together over scattered blocks of NaN-filled
caches; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal
transformers' for that prompt alone. Every config mixes sliding and full layers of different head
dims (the full ones with proportional, partial rope) and soft-caps the logits; norm weights, layer
scalars and router scales are drawn away from transformers' ones so each must load. The configs
cover the dense model, the MoE with attention_k_eq_v (26B-A4B's shape), and per-layer inputs with
KV-shared layers and double-wide MLPs (E2B's shape). Mutation checks break one Gemma-specific
mechanism at a time and show the parity then fails.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from executor.types_ import AttentionKind
from models.gemma_4 import Gemma4ForCausalLM
from module.attention import Attention, SharedKVAttention
from ops.attention.metadata import ScheduledSequence
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import GEMMA4_WINDOW, gemma4_config
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

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4
MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 16}
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
# Six layers, so that the two KV-shared ones (4 and 5) read layers 2 and 3, not the first of their type.
PLE_SHARED_KV = {
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
}
# name -> (Gemma4TextConfig overrides, KV block size)
CONFIGS = {
    "dense_untied": ({"tie_word_embeddings": False}, 4),
    "moe_k_eq_v": (MOE | K_EQ_V, 8),
    "per_layer_inputs_kv_shared": (PLE_SHARED_KV, 16),
}


def save_checkpoint(path: Path, config: transformers.Gemma4TextConfig, seed: int = 0) -> torch.nn.Module:
    """transformers' model with random weights, its norm weights, layer scalars and router scales
    (ones from transformers' init) drawn around one, saved to `path`; returned for reference."""
    redraw = {suffix: (1.0, 0.3) for suffix in ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")}
    return save_random_model(path, transformers.Gemma4ForCausalLM, config, seed, redraw)


def load_ours(path: Path, config: transformers.Gemma4TextConfig) -> Gemma4ForCausalLM:
    return paged_harness.load_ours(Gemma4ForCausalLM, path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[transformers.Gemma4ForCausalLM, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, gemma4_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Prompts and cached prefixes longer than the window (8), decoding past it with steps padded to 8 rows."""

    prefill_prompt_lens = (5, 17, 1, 9, 30)
    prefix_prompt_lens, prefix_splits = (21, 13), (12, 3)


def max_prefill_diff(hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]]) -> float:
    """The largest |ours - transformers'| over the last-token logits of `prompts` prefilled packed."""
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


def no_softcap(model: Gemma4ForCausalLM) -> None:
    model.final_logit_softcapping = None


def unscaled_embedding(model: Gemma4ForCausalLM) -> None:
    model.model.embed_scale.fill_(1.0)


def no_window(model: Gemma4ForCausalLM) -> None:
    for attention in model.modules():
        if isinstance(attention, (Attention, SharedKVAttention)):
            attention.sliding_window = None


def no_layer_scalar(model: Gemma4ForCausalLM) -> None:
    for layer in model.model.layers:
        layer.layer_scalar.fill_(1.0)


def no_per_layer_inputs(model: Gemma4ForCausalLM) -> None:
    for layer in model.model.layers:
        layer.has_per_layer_input = False


def shared_kv_from_the_first_layers(model: Gemma4ForCausalLM) -> None:
    """KV-shared layers handed the K/V of layers 0 and 1 (the first of each type) instead of 2 and 3."""
    for index, layer in enumerate(model.model.layers[:4]):
        layer.self_attn.stores_shared_kv = index < 2


def no_per_expert_scale(model: Gemma4ForCausalLM) -> None:
    for layer in model.model.layers:
        layer.router.per_expert_scale.fill_(1.0)


MUTATIONS: list[tuple[str, Callable[[Gemma4ForCausalLM], None]]] = [
    ("dense_untied", no_softcap),
    ("dense_untied", unscaled_embedding),
    ("dense_untied", no_window),
    ("dense_untied", no_layer_scalar),
    ("moe_k_eq_v", no_per_expert_scale),
    ("per_layer_inputs_kv_shared", no_per_layer_inputs),
    ("per_layer_inputs_kv_shared", shared_kv_from_the_first_layers),
]


@pytest.mark.parametrize(("config", "mutation"), MUTATIONS, ids=[m.__name__ for _, m in MUTATIONS])
def test_a_gemma_mechanism_broken_breaks_the_parity(
    config: str, mutation: Callable[[Gemma4ForCausalLM], None], tmp_path
):
    overrides, block_size = CONFIGS[config]
    hf_model, ours = parity_models(tmp_path, gemma4_config(**overrides), save_checkpoint, load_ours, block_size)
    prompts = random_prompts([5, 17, 30], seed=1)
    assert max_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    with torch.no_grad():
        mutation(ours.model)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


def test_the_cap_bends_the_tiny_models_logits():
    """So that the soft-capping tested above is not the identity on these logits: they reach past cap / 2."""
    hf_model = transformers.Gemma4ForCausalLM(gemma4_config(final_logit_softcapping=None)).eval()
    logits = hf_last_logits(hf_model, random_prompts([9], seed=1)[0])
    assert logits.abs().max() > gemma4_config().final_logit_softcapping / 2


def test_kv_shared_layers_project_only_q_and_read_their_sources_cache():
    config = gemma4_config(**PLE_SHARED_KV)
    model = Gemma4ForCausalLM(config, backend=cpu_backend())
    layers = model.model.layers
    assert [layer.self_attn.qkv_proj.parts for layer in layers] == ["qkv"] * 4 + ["q"] * 2
    sources = [layer.self_attn.attn.source.layer for layer in layers[4:]]
    assert sources == [layers[2].self_attn.attn, layers[3].self_attn.attn]
    assert [layer.mlp.down_proj.weight.shape[1] for layer in layers] == [48] * 4 + [96] * 2  # double-wide


def test_full_layers_with_k_eq_v_project_no_v():
    model = Gemma4ForCausalLM(gemma4_config(**K_EQ_V), backend=cpu_backend())
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.qkv_proj.parts for a in attention] == ["qkv", "qk", "qkv", "qk"]
    assert [(a.head_dim, a.num_kv_heads) for a in attention] == [(16, 2), (32, 1), (16, 2), (32, 1)]


# Every router's weights zero: each expert scores 1/8, so the experts tie for the top_k places and
# only top-k's tie-breaking chooses; their per_expert_scale values differ, so the choice shows in
# the output.
@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[transformers.Gemma4ForCausalLM, PagedModel]:
    config = gemma4_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], **MOE)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.router.proj.weight.zero_()
    hf_model.save_pretrained(path)  # the same checkpoint with the tied routers
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


def test_zero_router_weights_tie_every_expert(tied_routing_models):
    hf_model, _ = tied_routing_models
    probabilities, _, _ = hf_model.model.layers[0].router(torch.randn(32, hf_model.config.hidden_size))
    assert (probabilities == 1 / hf_model.config.num_experts).all()
    assert hf_model.model.layers[0].router.per_expert_scale.unique().numel() == hf_model.config.num_experts


class TestRoutingTies(RoutingTieTests):
    """Every expert tied (tied_routing_models), as the test above shows."""


# Every mechanism at once, through the whole engine: MoE with k_eq_v, per-layer inputs, KV-shared layers.
ENGINE_GEMMA4 = MOE | K_EQ_V | PLE_SHARED_KV | ENGINE_CONFIG


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine on a saved tiny checkpoint, found by cann-recipes' name, with prefill chunks
    of at most 16 tokens and 16 usable blocks of 16 tokens over two cache groups for a batch whose
    requests need 2 to 5 blocks in each: chunked prompts and preempted requests."""
    config = gemma4_config(**ENGINE_GEMMA4)
    path = tmp_path_factory.mktemp("tiny_gemma4")
    hf_model = save_checkpoint(path, config)
    run = generate_random_prompts(path, "gemma_4", max_prefill_tokens=16, num_blocks=17, max_model_len=80)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, Gemma4ForCausalLM)


def test_kv_shared_layers_hold_no_cache_and_each_kind_a_group(engine_run):
    _, inference, _, _ = engine_run
    worker = inference.engine.worker
    groups = worker.kv_cache_groups
    assert [g.spec.kind for g in groups] == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]
    assert [len(g.layer_names) for g in groups] == [2, 2] and groups[0].spec.sliding_window == GEMMA4_WINDOW
    assert all(".layers.4." not in name and ".layers.5." not in name for name in worker.kv_cache_layers)
    # sliding: K and V of 2 heads x 16; full (k_eq_v): K and V of 1 head x 32; fp32, two layers each
    assert [g.spec.bytes_per_token for g in groups] == [2 * 2 * 16 * 4, 2 * 1 * 32 * 4]


def test_a_multimodal_checkpoints_language_model_loads_and_its_towers_are_skipped():
    config = gemma4_config()
    hf_model = transformers.Gemma4ForCausalLM(config)
    weights = [(name.replace("model.", "model.language_model.", 1), t) for name, t in hf_model.state_dict().items()]
    weights.append(("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight", torch.zeros(2, 2)))
    ours = Gemma4ForCausalLM(config, backend=cpu_backend())
    assert ours.load_weights(weights) == {name for name, _ in ours.named_parameters()}


def test_model_refuses_a_backend_without_its_moe_op_at_construction(monkeypatch):
    backend = npu_backend(monkeypatch, "eager", RecordingTorchNpu())
    with pytest.raises(NotImplementedError, match="moe_experts_gelu_tanh.*npu backend does not have"):
        Gemma4ForCausalLM(gemma4_config(**MOE), backend=backend)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_nextn_predict_layers": 1}, "no MTP modules"),
        ({"hidden_activation": "silu"}, "hidden_activation must be 'gelu_pytorch_tanh'"),
        ({"use_bidirectional_attention": "all"}, "only causal attention"),
    ],
)
def test_a_config_that_is_not_gemma4_as_built_here_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        Gemma4ForCausalLM(gemma4_config(**overrides), backend=cpu_backend())


def test_decode_forward_traces_as_one_graph_and_matches_eager(tmp_path):
    """What the graph modes need (fullgraph, static shapes), with every mechanism in the model."""
    config = gemma4_config(**(MOE | K_EQ_V | PLE_SHARED_KV))
    save_checkpoint(tmp_path, config)
    ours = PagedModel(load_ours(tmp_path, config), block_size=4)
    check_decode_traces_as_one_graph(ours, random_prompts([3, 12, 5], seed=8))
