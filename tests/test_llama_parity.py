"""models/llama against transformers' LlamaForCausalLM with the same weights, on the paged path.

Prompts run packed together over scattered KV blocks (NaN in every slot not yet written); each
prompt's logits and greedy tokens must equal HF's for that prompt alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from executor.types_.errors import WeightLoadError
from models.llama import LlamaForCausalLM
from tests.backends import cpu_backend
from tests.factories import llama_config
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    single_thread,  # noqa: F401 (an autouse fixture)
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
# name -> (LlamaConfig overrides, KV block size)
CONFIGS = {
    "mha_untied": ({"num_key_value_heads": 4}, 4),
    "gqa2_tied": ({"num_key_value_heads": 2, "tie_word_embeddings": True}, 16),
    "mqa_linear_rope": (
        {"num_key_value_heads": 1, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        4,
    ),
    "gqa2_llama3_rope_biases": (
        {"num_key_value_heads": 2, "rope_parameters": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True},
        16,
    ),
}


def paged_llama(config: transformers.LlamaConfig, hf_model: torch.nn.Module, block_size: int) -> PagedModel:
    """Our model with HF's weights, over NaN-filled caches and scattered blocks."""
    model = LlamaForCausalLM(config, backend=cpu_backend())
    filled = model.load_weights(hf_model.state_dict().items())
    assert filled == {name for name, _ in model.named_parameters()}
    return PagedModel(model, block_size, max_model_len=config.max_position_embeddings)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request) -> tuple[torch.nn.Module, PagedModel]:
    overrides, block_size = CONFIGS[request.param]
    config = llama_config(**overrides)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    return hf_model, paged_llama(config, hf_model, block_size)


class TestPagedParity(PagedParityTests):
    """Longer greedy runs of more prompts, decode steps unpadded."""

    decode_prompt_lens = (3, 11, 6, 1, 15, 8, 4, 20)
    max_new_tokens = 32
    decode_pad_to = 0


def test_tied_model_ignores_lm_head_in_checkpoint_and_loads_without_it():
    model = LlamaForCausalLM(llama_config(tie_word_embeddings=True, num_key_value_heads=2), backend=cpu_backend())
    state = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=False, num_key_value_heads=2)).state_dict()
    with_head = model.load_weights(state.items())
    without_head = model.load_weights((k, v) for k, v in state.items() if k != "lm_head.weight")
    assert with_head == without_head == {name for name, _ in model.named_parameters()}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_merged_parameter_counts_as_filled_only_with_all_shards():
    model = LlamaForCausalLM(llama_config(num_key_value_heads=2), backend=cpu_backend())
    state = transformers.LlamaForCausalLM(llama_config(num_key_value_heads=2)).state_dict()
    filled = model.load_weights((k, v) for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight")
    assert {name for name, _ in model.named_parameters()} - filled == {"model.layers.1.self_attn.qkv_proj.weight"}


def test_unexpected_checkpoint_tensor_is_named():
    model = LlamaForCausalLM(llama_config(), backend=cpu_backend())
    with pytest.raises(WeightLoadError, match="model.layers.0.self_attn.q_norm.weight"):
        model.load_weights([("model.layers.0.self_attn.q_norm.weight", torch.zeros(16))])


def test_shape_mismatch_names_tensor_and_both_shapes():
    model = LlamaForCausalLM(llama_config(num_key_value_heads=2), backend=cpu_backend())
    with pytest.raises(WeightLoadError, match=r"k_proj.weight.*expected \(32, 64\), got \(64, 64\)"):
        model.load_weights([("model.layers.2.self_attn.k_proj.weight", torch.zeros(64, 64))])


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_sequence_dependent_rope_is_rejected(rope_type):
    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        rope.update(short_factor=[1.0] * 8, long_factor=[1.0] * 8, original_max_position_embeddings=64)
    with pytest.raises(ValueError, match=rope_type):
        LlamaForCausalLM(llama_config(rope_parameters=rope), backend=cpu_backend())
