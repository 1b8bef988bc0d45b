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

from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM
from module.mlp import GatedMLP
from module.moe import SparseMoeBlock
from tests.backends import cpu_backend
from tests.engine_harness import ENGINE_CONFIG, check_engine_greedy, generate_random_prompts
from tests.factories import qwen_config
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    RoutingTieTests,
    hf_last_logits,
    load_ours,
    parity_models,
    random_prompts,
    save_random_model,
    single_thread,  # noqa: F401 (an autouse fixture)
)

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


def save_checkpoint(path: Path, config: transformers.PretrainedConfig) -> torch.nn.Module:
    """Write a model folder for `config` and return transformers' model (of the config's family) with
    its weights: random, with the biases (zero at init) and the norm weights (one at init) drawn too,
    so that each must land."""
    redraw = {"bias": (0.0, 0.1), "norm.weight": (1.0, 0.1)}
    return save_random_model(path, FAMILIES[config.model_type][0], config, redraw=redraw)


def load_qwen(path: Path, config: transformers.PretrainedConfig) -> torch.nn.Module:
    """Our model of the config's family with the weights of model folder `path`."""
    return load_ours(FAMILIES[config.model_type][1], path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    family, overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, qwen_config(family, **overrides), save_checkpoint, load_qwen, block_size)


class TestPagedParity(PagedParityTests):
    """Packed prefill, prefill over a cached prefix, and batched greedy decoding with steps padded to
    8 rows, each against transformers."""


def test_qwen2_sliding_layers_are_those_transformers_slides():
    config = qwen_config("qwen2", **CONFIGS["qwen2_tied_mqa_sliding"][1])
    model = Qwen2ForCausalLM(config, backend=cpu_backend())
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, WINDOW, WINDOW]
    assert [layer.self_attn.qkv_proj.bias is not None for layer in model.model.layers] == [True] * 3
    assert all(layer.self_attn.o_proj.bias is None for layer in model.model.layers)


def test_qwen3_moe_sparse_layers_are_those_transformers_builds():
    config = qwen_config("qwen3_moe", **CONFIGS["qwen3_moe_dense_and_sparse_tied"][1])
    ours = Qwen3MoeForCausalLM(config, backend=cpu_backend())
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
    config = qwen_config("qwen3_moe", num_hidden_layers=2, norm_topk_prob=True)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        hf_model.model.layers[0].mlp.gate.weight.zero_()
        router = hf_model.model.layers[1].mlp.gate.weight
        router[TIED_EXPERTS] = 3 * router[0]
    hf_model.save_pretrained(path)  # the same checkpoint with the tied routers
    return hf_model, PagedModel(load_qwen(path, config), block_size=4)


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


class TestRoutingTies(RoutingTieTests):
    """Layer 0's zero router and layer 1's equal rows (TIED_EXPERTS), as the test above shows."""

    tie_prompt_lens = (7, 4, 12)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_equals_transformers_generate(family, tmp_path):
    """The whole engine (scheduler, KV cache manager, worker) on a saved model folder with a tokenizer."""
    hf_model = save_checkpoint(tmp_path, qwen_config(family, **ENGINE_CONFIG))
    inference, prompts, result = generate_random_prompts(tmp_path, family)
    assert isinstance(inference.engine.worker.model, FAMILIES[family][1])
    check_engine_greedy(hf_model, prompts, result)
