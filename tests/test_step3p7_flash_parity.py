"""models/step3p7_flash against transformers' Step3p7ForConditionalGeneration (text only) with the
same weights, on the paged path.

Prompts longer than the sliding window run packed together over scattered blocks of NaN-filled
caches; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal transformers'
for that prompt alone. The configs mix sliding layers (more heads, their own rope) and full ones
(partial rope with llama3 scaling), dense and MoE layers, clamped SwiGLUs, drawn norm weights and
router biases; routing ties break as transformers breaks them; the whole engine runs with chunked
prefill and a pool that preempts. Breaking each of the family's own mechanisms on purpose must break
the parity, so that the tests could not pass without it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from executor.core.config import load_config
from executor.core.config.model_registry import model_folder
from executor.offline.__main__ import main as offline_main
from executor.types_ import AttentionKind
from models.llama.model import LlamaAttention
from models.step3p7_flash import Step3p7ForCausalLM
from models.step3p7_flash.model import ClampedGatedMLP, Step3p7Attention, Step3p7Experts
from module.moe import TopkRouter
from module.norm import RMSNorm
from ops.attention.metadata import ScheduledSequence
from tests import paged_harness
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
)
from tests.factories import STEP3P7_WINDOW, step3p7_config
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
CANN_YAML = ROOT / "tests" / "data" / "cann_recipes" / "step3p7_flash.yaml"
PARALLEL_KEYS = ("world_size", "dense_tp_size", "embed_tp_size", "lmhead_tp_size")
TOLERANCE = PagedParityTests.tolerance
# transformers' init leaves norm weights (of 1 + w) and router biases zero: drawn so that each must load.
REDRAW = {"norm.weight": (0.0, 0.3), "e_score_correction_bias": (0.0, 0.1)}

# name -> (text config overrides, KV block size)
CONFIGS = {
    "sliding_and_full_partial_llama3_clamped": ({}, 4),
    "tied_all_sparse_equal_heads_scaled_queries": (
        {
            "tie_word_embeddings": True,
            "mlp_layer_types": ["sparse"] * 4,
            "num_sliding_attention_heads": 4,
            "query_pre_attn_scalar": 24,
            "swiglu_limits": None,
            "swiglu_limits_shared": None,
        },
        8,
    ),
}


def save_checkpoint(path: Path, config: transformers.Step3p7Config, seed: int = 0) -> torch.nn.Module:
    """A model folder for `config` in Step-3.7's checkpoint format (transformers writes it so), and
    transformers' model with its weights."""
    return save_random_model(path, transformers.Step3p7ForConditionalGeneration, config, seed, REDRAW)


def load_ours(path: Path, config: transformers.Step3p7Config) -> Step3p7ForCausalLM:
    """Ours over the text config the engine reads from the folder (config_cls.from_pretrained)."""
    text_config = transformers.Step3p7TextConfig.from_pretrained(path)
    assert text_config.to_dict() == config.text_config.to_dict() | {"transformers_version": transformers.__version__}
    return paged_harness.load_ours(Step3p7ForCausalLM, path, text_config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, step3p7_config(**overrides), save_checkpoint, load_ours, block_size)


class TestPagedParity(PagedParityTests):
    """Prompts and cached prefixes longer than the window (8), decoding past it with steps padded to 8 rows."""

    prefill_prompt_lens = (5, 17, 1, 9, 30)
    prefix_prompt_lens, prefix_splits = (21, 13), (12, 3)


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    """Layer 1's router weights and biases zero: all 8 experts score sigmoid(0) for every token, so
    the top 3 are chosen by top-k's tie-breaking alone."""
    overrides = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    config = step3p7_config(mlp_layer_types=["dense", "sparse"], **overrides)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        gate = hf_model.model.language_model.layers[1].mlp.gate
        gate.weight.zero_()
        gate.e_score_correction_bias.zero_()
    hf_model.save_pretrained(path)  # the same checkpoint with the tied router
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


class TestRoutingTies(RoutingTieTests):
    """Every expert tied in layer 1 (tied_routing_models)."""


def test_the_tied_router_leaves_the_choice_to_top_k(tied_routing_models):
    hf_model, _ = tied_routing_models
    gate = hf_model.model.language_model.layers[1].mlp.gate
    logits, weights, _ = gate(torch.randn(16, hf_model.config.text_config.hidden_size))
    assert (logits == 0).all() and torch.allclose(weights, torch.full_like(weights, 1 / 3))


def modules_of(model: Step3p7ForCausalLM, cls: type) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, cls)]


def ungated_attention(model: Step3p7ForCausalLM) -> None:
    """The heads' output straight into o_proj, without the sigmoid gate."""
    for attention in modules_of(model, Step3p7Attention):
        attention.attend = functools.partial(LlamaAttention.attend, attention)


def plain_norms(model: Step3p7ForCausalLM) -> None:
    """Every RMSNorm scaled by w, not 1 + w."""
    for norm in modules_of(model, RMSNorm):
        norm.weight -= 1


def one_rope_for_both_layer_types(model: Step3p7ForCausalLM) -> None:
    """The full layers rotated as the sliding ones: every dim, at the sliding layers' theta."""
    tables = model.model.rotary_emb.tables
    tables["full_attention"] = tables["sliding_attention"]


def no_window(model: Step3p7ForCausalLM) -> None:
    """Sliding layers attending over the whole sequence."""
    for attention in modules_of(model, Step3p7Attention):
        attention.attn.sliding_window = None


def unbiased_choice(model: Step3p7ForCausalLM) -> None:
    """Experts chosen by their sigmoid scores alone, without the router bias."""
    for router in modules_of(model, TopkRouter):
        router.e_score_correction_bias.zero_()


def unclamped_swiglu(model: Step3p7ForCausalLM) -> None:
    """The last layer's experts, shared expert and dense MLPs without their clamp."""
    for experts in modules_of(model, Step3p7Experts):
        experts.limit = None
    for mlp in modules_of(model, ClampedGatedMLP):
        mlp.limit = float("inf")


def unscaled_routing(model: Step3p7ForCausalLM) -> None:
    """The routed experts' sum without moe_router_scaling_factor."""
    for router in modules_of(model, TopkRouter):
        router.routed_scaling_factor = 1.0


MUTATIONS = [
    ungated_attention,
    plain_norms,
    one_rope_for_both_layer_types,
    no_window,
    unbiased_choice,
    unclamped_swiglu,
    unscaled_routing,
]


@pytest.fixture(scope="module")
def mutation_checkpoint(tmp_path_factory) -> tuple[Path, transformers.Step3p7Config, torch.nn.Module]:
    config = step3p7_config()
    path = tmp_path_factory.mktemp("mutations")
    return path, config, save_checkpoint(path, config)


def max_prefill_diff(hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]]) -> float:
    """The largest |ours - transformers'| over the last-token logits of `prompts` prefilled packed."""
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_breaking_a_mechanism_of_the_family_breaks_the_parity(
    mutation: Callable[[Step3p7ForCausalLM], None], mutation_checkpoint
):
    path, config, hf_model = mutation_checkpoint
    ours = PagedModel(load_ours(path, config), block_size=4)
    prompts = random_prompts(PagedParityTests.prefill_prompt_lens + (30,), seed=1)
    assert max_prefill_diff(hf_model, ours, prompts) <= TOLERANCE
    with torch.no_grad():
        mutation(ours.model)
    assert max_prefill_diff(hf_model, ours, prompts) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window None"),
        ({"gating": False}, "config gating False"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ],
)
def test_a_config_not_built_here_is_refused(overrides, message):
    """Configs transformers accepts (the per-element gates it cannot run either)."""
    with pytest.raises(ValueError, match=message):
        Step3p7ForCausalLM(step3p7_config(**overrides).text_config, backend=cpu_backend())


def test_model_refuses_a_backend_without_its_ops_at_construction(monkeypatch):
    backend = npu_backend(monkeypatch, "eager", RecordingTorchNpu())
    with pytest.raises(NotImplementedError, match="moe_experts.*npu backend does not have"):
        Step3p7ForCausalLM(step3p7_config().text_config, backend=backend)


def test_mtp_and_vision_tensors_are_passed_over(mutation_checkpoint, tmp_path):
    """A checkpoint's MTP layers (model.layers.{N+i}) and vision tower are not built and not loaded."""
    path, config, _ = mutation_checkpoint
    model = Step3p7ForCausalLM(config.text_config, backend=cpu_backend())
    extra = [("model.layers.4.eh_proj.weight", torch.zeros(64, 128)), ("vision_model.conv1.weight", torch.zeros(1))]
    filled = model.load_weights(extra)
    assert filled == set() and model.num_mtp_layers == 0


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint, found by
    cann-recipes' name, with prefill chunks of at most 16 tokens and 17 usable blocks of 16 tokens
    over the two cache groups (the smallest pool that holds one request of 128 tokens) for a batch
    whose requests need 2 to 7 each: chunked prompts and preempted requests."""
    path = tmp_path_factory.mktemp("tiny_step3p7_flash")
    hf_model = save_checkpoint(path, step3p7_config(**ENGINE_CONFIG))
    run = generate_random_prompts(path, "step3p7_flash", max_prefill_tokens=16, num_blocks=18, max_model_len=128)
    return hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, Step3p7ForCausalLM)


def test_sliding_and_full_layers_get_a_cache_group_each(engine_run):
    _, inference, _, _ = engine_run
    groups = inference.engine.worker.kv_cache_groups
    assert [g.spec.kind for g in groups] == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]
    assert [len(g.layer_names) for g in groups] == [2, 2] and groups[0].spec.sliding_window == STEP3P7_WINDOW


def test_decode_forward_traces_as_one_graph_and_matches_eager(mutation_checkpoint):
    """What the graph modes need (fullgraph, static shapes), with both layer types and the clamped experts."""
    path, config, _ = mutation_checkpoint
    ours = PagedModel(load_ours(path, config), block_size=4)
    check_decode_traces_as_one_graph(ours, random_prompts([3, 12, 5], seed=8))


def test_the_cann_recipes_yaml_validates_and_runs_on_the_tiny_model_cut_by_its_layer_override(
    tmp_path, monkeypatch, caplog
):
    """Our step3p7_flash.yaml in cann-recipes' keys: it loads (no unknown key), its model_name finds
    this folder, and it runs end to end on tiny_random with random weights (with_ckpt False), one
    process on CPU and eager in place of its 8 ranks and ge_graph, cut to 2 layers by
    custom_params.num_hidden_layers."""
    config = load_config(CANN_YAML)
    assert model_folder(config.model_config.model_name) == "step3p7_flash" and not config.model_config.with_ckpt
    monkeypatch.chdir(ROOT)
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    settings = {
        "model_config.model_path": "models/step3p7_flash/tiny_random",
        "model_config.output_path": str(out),
        "model_config.device": "cpu",
        "model_config.exe_mode": "eager",
        "data_config.apply_chat_template": "false",  # the tiny tokenizer has no chat template
        "data_config.num_prompts": 4,  # the shipped list's first prompts, which are plain text
        **{f"parallel_config.{key}": 1 for key in PARALLEL_KEYS},
    }
    arguments = [argument for key, value in settings.items() for argument in ("--set", f"{key}={value}")]
    assert offline_main(["--yaml", str(CANN_YAML), *arguments]) == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 16 for line in lines)
    assert "custom_params.num_hidden_layers: 2 of the config's 4 layers" in caplog.text
