"""models/qwen2, qwen3 and qwen3_moe against transformers' Qwen2/Qwen3/Qwen3Moe ForCausalLM with the
same weights, on the paged path.

Prompts run packed together over scattered blocks of NaN-filled caches; each prompt's logits (fp32,
max-abs-diff <= 1e-4) and greedy tokens must equal transformers' for that prompt alone. The configs
cover tied and untied embeddings, Qwen2's q/k/v biases and sliding layers, Qwen3's q/k norms with a
head_dim of its own and attention_bias, and Qwen3-MoE's dense and sparse layers (mlp_only_layers,
decoder_sparse_step), norm_topk_prob both ways, and routing ties at the top-k cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import ops
from executor.core.engine.step_inputs import ScheduledSequence
from executor.offline.__main__ import main as offline_main
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM
from module.mlp import GatedMLP
from module.moe import SparseMoeBlock
from tests.conftest import tiny_tokenizer
from tests.engine_harness import hf_greedy, make_inference, token_records
from tests.paged_harness import (
    VOCAB,
    PagedModel,
    hf_generate,
    hf_last_logits,
    load_ours,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)

TOLERANCE = 1e-4
ROOT = Path(__file__).resolve().parents[1]
# family -> (transformers' class, ours)
FAMILIES: dict[str, tuple[type, type]] = {
    "qwen2": (transformers.Qwen2ForCausalLM, Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3ForCausalLM, Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, Qwen3MoeForCausalLM),
}
WINDOW = 8
# name -> (family, config overrides, KV block size)
CONFIGS = {
    "qwen2_untied_gqa": ("qwen2", {}, 4),
    "qwen2_tied_mqa_sliding": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "num_key_value_heads": 1,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,  # layer 0 full, layers 1 and 2 sliding
        },
        16,
    ),
    "qwen3_untied_wide_heads": ("qwen3", {"head_dim": 32}, 4),  # 4 x 32 != hidden 64
    "qwen3_tied_attention_bias": ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}, 16),
    "qwen3_moe_all_sparse_renormalised": ("qwen3_moe", {"norm_topk_prob": True}, 4),
    "qwen3_moe_dense_and_sparse_tied": (
        "qwen3_moe",
        {
            "tie_word_embeddings": True,
            "num_hidden_layers": 4,
            "mlp_only_layers": [0],
            "decoder_sparse_step": 2,  # layers 1 and 3 sparse; 0 (listed) and 2 dense
            "norm_topk_prob": False,
        },
        8,
    ),
}
PREFILL_PROMPT_LENS = [5, 17, 1, 9, 12]
DECODE_PROMPT_LENS = [3, 11, 6, 1, 15, 8]
MAX_NEW_TOKENS = 16


def qwen_config(family: str, **overrides: object) -> transformers.PretrainedConfig:
    """Three tiny layers, GQA (4 heads over 2), 8 experts choosing 2 for MoE; overrides change any field."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,  # peaked logits, so greedy choices are far from ties
        bos_token_id=None,
        eos_token_id=None,  # HF generate must not stop early
        pad_token_id=None,
        attn_implementation="eager",
    )
    if family == "qwen3":
        settings["head_dim"] = 16
    if family == "qwen3_moe":
        settings |= dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    settings.update(overrides)
    return transformers.AutoConfig.for_model(family, **settings)


def save_checkpoint(path: Path, family: str, config: transformers.PretrainedConfig) -> torch.nn.Module:
    """Write a model folder for `config` and return transformers' model with its weights: random, with
    the biases (zero at init) and the norm weights (one at init) drawn too, so that each must land."""
    torch.manual_seed(0)
    model = FAMILIES[family][0](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    ops.set_backend("torch")
    family, overrides, block_size = CONFIGS[request.param]
    config = qwen_config(family, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(path, family, config)
    return hf_model, PagedModel(load_ours(FAMILIES[family][1], path, config), block_size)


def test_packed_prefill_logits_match_hf_per_prompt(models):
    hf_model, ours = models
    prompts = random_prompts(PREFILL_PROMPT_LENS, seed=1)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    assert logits.shape == (len(prompts), VOCAB)
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
    """Decode steps padded to a bucket of 8 rows, as a graph would run them."""
    hf_model, ours = models
    prompts = random_prompts(DECODE_PROMPT_LENS, seed=3)
    outputs = ours.greedy(prompts, MAX_NEW_TOKENS, pad_to=8)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_generate(hf_model, prompt, MAX_NEW_TOKENS)


def test_qwen2_sliding_layers_are_those_transformers_slides():
    config = qwen_config("qwen2", **CONFIGS["qwen2_tied_mqa_sliding"][1])
    model = Qwen2ForCausalLM(config)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, WINDOW, WINDOW]
    assert [layer.self_attn.qkv_proj.bias is not None for layer in model.model.layers] == [True] * 3
    assert all(layer.self_attn.o_proj.bias is None for layer in model.model.layers)


def test_qwen3_moe_sparse_layers_are_those_transformers_builds():
    config = qwen_config("qwen3_moe", **CONFIGS["qwen3_moe_dense_and_sparse_tied"][1])
    ours = Qwen3MoeForCausalLM(config)
    hf_model = transformers.Qwen3MoeForCausalLM(config)
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf_model.model.layers]
    assert hf_sparse == [False, True, False, True]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == hf_sparse
    assert all(
        isinstance(layer.mlp, GatedMLP)
        for layer, sparse in zip(ours.model.layers, hf_sparse, strict=True)
        if not sparse
    )


# Layer 0's router is zero: all 8 experts score 1/8 and any 2 of them tie. Layer 1's router rows 0-2
# are one row scaled up: those three experts score exactly alike and often lead, so 3 tie for 2 places.
TIED_EXPERTS = [0, 1, 2]


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    ops.set_backend("torch")
    config = qwen_config("qwen3_moe", num_hidden_layers=2, norm_topk_prob=True)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, "qwen3_moe", config)
    with torch.no_grad():
        hf_model.model.layers[0].mlp.gate.weight.zero_()
        router = hf_model.model.layers[1].mlp.gate.weight
        router[TIED_EXPERTS] = 3 * router[0]
    hf_model.save_pretrained(path)  # the same checkpoint with the tied routers
    return hf_model, PagedModel(load_ours(Qwen3MoeForCausalLM, path, config), block_size=4)


def test_tie_config_puts_equal_scores_at_the_top_k_cut(tied_routing_models):
    hf_model, _ = tied_routing_models
    routed = []
    gate = hf_model.model.layers[1].mlp.gate
    handle = gate.register_forward_hook(lambda module, inputs, output: routed.append(output))
    try:
        hf_last_logits(hf_model, random_prompts([12], seed=4)[0])
    finally:
        handle.remove()
    router_logits, _, topk_ids = routed[0]
    tied = router_logits[:, TIED_EXPERTS]
    assert torch.equal(tied, tied[:, :1].expand_as(tied))  # bitwise equal scores
    chosen_of_tied = [len(set(row.tolist()) & set(TIED_EXPERTS)) for row in topk_ids]
    assert any(0 < count < len(TIED_EXPERTS) for count in chosen_of_tied)  # the cut falls inside the tie


def test_routing_ties_break_as_in_transformers(tied_routing_models):
    hf_model, ours = tied_routing_models
    prompts = random_prompts([7, 4, 12], seed=4)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE
    assert ours.greedy(prompts, 8) == [hf_generate(hf_model, p, 8) for p in prompts]


ENGINE_PROMPT_LENS = [1, 5, 17, 33, 8, 40, 3]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_equals_transformers_generate(family, tmp_path):
    """The whole engine (scheduler, KV cache manager, worker) on a saved model folder with a tokenizer."""
    ops.set_backend("torch")
    config = qwen_config(family, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    hf_model = save_checkpoint(tmp_path, family, config)
    tiny_tokenizer().save_pretrained(tmp_path)
    inference = make_inference(tmp_path, model_config={"model_name": family}, batch_size=len(ENGINE_PROMPT_LENS))
    assert isinstance(inference.engine.worker.model, FAMILIES[family][1])
    prompts = random_prompts(ENGINE_PROMPT_LENS, seed=5)
    result = inference.generate(token_records(prompts))
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf_model, p, 32) for p in prompts]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_random_yaml_runs_end_to_end(family, tmp_path):
    """models/<family>/config/tiny_random.yaml: random weights, byte-level tokenizer, the shipped prompts."""
    yaml = ROOT / "models" / family / "config" / "tiny_random.yaml"
    output_dir = tmp_path / "run"
    overrides = [
        "data_config.num_prompts=3",
        "scheduler_config.max_new_tokens=4",
        f"model_config.output_path={output_dir}",
    ]
    status = offline_main(["--yaml", str(yaml), *(arg for o in overrides for arg in ("--set", o))])
    assert status == 0
    lines = (output_dir / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 3
