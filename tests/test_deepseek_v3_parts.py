"""DeepSeek-V3's parts on their own: the two MLA forms, the latent cache spec, the MoE experts op and
its tensor-parallel weights, weight loading errors, and the refusal of backends without MLA ops."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from executor.model_loader.default_loader import safetensors_weights
from executor.types_.errors import WeightLoadError
from executor.types_.kv_cache_spec import AttentionKind, KVTensorSpec, TPSplit, mla_spec
from models.deepseek_v3 import DeepseekV3ForCausalLM
from module.moe import FusedExperts
from module.parallel_group import ParallelGroup
from ops import torch_ref
from ops.attention import reference
from tests.backends import cpu_backend
from tests.deepseek_v3_harness import load_ours, save_checkpoint
from tests.factories import deepseek_config
from tests.npu_stand_ins import RecordingTorchNpu, npu_backend
from tests.paged_harness import PagedModel, check_decode_traces_as_one_graph, random_prompts

NUM_HEADS, NOPE, ROPE, RANK, V_DIM = 4, 16, 8, 32, 12


def test_absorbed_decode_equals_naive_decompression():
    """One query per request over a NaN-filled cache (only each request's own slots written) with
    block tables of fixed width padded with the null block 0."""
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks, table_width = 4, 32, 8
    seq_lens = [5, 1, 13, 32, 8]
    latent_cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"))
    free_blocks = random.Random(0).sample(range(1, num_blocks), num_blocks - 1)
    block_table = torch.zeros(len(seq_lens), table_width, dtype=torch.int32)
    for row, seq_len in enumerate(seq_lens):
        count = -(-seq_len // block_size)
        blocks, free_blocks = free_blocks[:count], free_blocks[count:]
        block_table[row, :count] = torch.tensor(blocks)
        for position in range(seq_len):
            latent_cache[blocks[position // block_size], position % block_size] = torch.randn(
                RANK + ROPE, generator=generator
            )
    q_nope = torch.randn(len(seq_lens), NUM_HEADS, NOPE, generator=generator)
    q_pe = torch.randn(len(seq_lens), NUM_HEADS, ROPE, generator=generator)
    kv_b_weight = torch.randn(NUM_HEADS * (NOPE + V_DIM), RANK, generator=generator) * 0.2
    scale = (NOPE + ROPE) ** -0.5
    absorbed = reference.mla_decode_absorbed(
        q_nope, q_pe, latent_cache, kv_b_weight, block_table, torch.tensor(seq_lens), scale
    )
    query_ends = list(range(1, len(seq_lens) + 1))
    naive = reference.mla_attention_naive(
        q_nope, q_pe, latent_cache, kv_b_weight, block_table, query_ends, seq_lens, scale
    )
    assert absorbed.shape == (len(seq_lens), NUM_HEADS, V_DIM)
    assert not absorbed.isnan().any()
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)


def test_mla_cache_spec_is_one_latent_per_token_not_per_head():
    spec = mla_spec(512, 64, torch.bfloat16)  # DeepSeek-V3's dims
    assert spec.tensors == (KVTensorSpec("latent", (576,), torch.bfloat16, tp_split=TPSplit.WHOLE),)  # every head's
    assert spec.kind is AttentionKind.FULL
    assert spec.bytes_per_token == 576 * 2


def test_layers_declare_the_latent_spec_in_the_models_dtype():
    config = deepseek_config()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = DeepseekV3ForCausalLM(
            config, backend=cpu_backend(torch.bfloat16)
        )  # the model dtype, as the engine hands it
    finally:
        torch.set_default_dtype(previous)
    specs = {layer.self_attn.kv_cache_spec() for layer in model.model.layers}
    assert specs == {mla_spec(config.kv_lora_rank, config.qk_rope_head_dim, torch.bfloat16)}
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32


def test_moe_experts_sum_each_tokens_chosen_experts_by_weight():
    generator = torch.Generator().manual_seed(1)
    num_tokens, hidden, intermediate, num_experts, top_k = 7, 16, 8, 5, 2
    hidden_states = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, intermediate, generator=generator)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    topk_weights = torch.rand(num_tokens, top_k, generator=generator)
    expected = torch.zeros(num_tokens, hidden)
    for token in range(num_tokens):
        for slot in range(top_k):
            expert = topk_ids[token, slot]
            gate, up = (gate_up[expert] @ hidden_states[token]).chunk(2)
            expected[token] += topk_weights[token, slot] * (down[expert] @ (F.silu(gate) * up))
    actual = torch_ref.moe_experts(hidden_states, topk_weights, topk_ids, gate_up, down)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)


def test_expert_weights_split_the_intermediate_dim_over_tp_ranks():
    gate, up, down = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    ranks = [FusedExperts(3, 16, 8, tp=ParallelGroup("moe_tp", rank, 2), backend=cpu_backend()) for rank in range(2)]
    for layer in ranks:
        assert layer.load_expert_weight(gate, 1, "gate_proj") == "gate_up_proj"
        layer.load_expert_weight(up, 1, "up_proj")
        assert layer.load_expert_weight(down, 1, "down_proj") == "down_proj"
    gate_parts, up_parts = zip(*(layer.gate_up_proj.data[1].split(4) for layer in ranks), strict=True)
    torch.testing.assert_close(torch.cat(gate_parts), gate)
    torch.testing.assert_close(torch.cat(up_parts), up)
    torch.testing.assert_close(torch.cat([layer.down_proj.data[1] for layer in ranks], dim=1), down)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    config = deepseek_config(num_nextn_predict_layers=1)
    path = tmp_path_factory.mktemp("deepseek_v3_loading")
    save_checkpoint(path, config)
    return config, list(safetensors_weights(path))


def test_mtp_copies_of_embedding_and_head_are_shared_not_loaded(checkpoint):
    config, tensors = checkpoint
    names = {name for name, _ in tensors}
    assert {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"} <= names
    model = DeepseekV3ForCausalLM(config, backend=cpu_backend())
    assert model.load_weights(tensors) == {name for name, _ in model.named_parameters()}
    assert model.num_mtp_layers == 1


def test_a_missing_expert_projection_leaves_its_stacked_parameter_unfilled(checkpoint):
    config, tensors = checkpoint
    model = DeepseekV3ForCausalLM(config, backend=cpu_backend())
    filled = model.load_weights((n, t) for n, t in tensors if n != "model.layers.2.mlp.experts.5.up_proj.weight")
    assert {name for name, _ in model.named_parameters()} - filled == {"model.layers.2.mlp.experts.gate_up_proj"}


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("model.layers.1.self_attn.kv_b_proj.weight_scale_inv", (1, 1), "FP8 block scale"),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", (32, 64), "no routed experts at 'model.layers.0"),
        ("model.layers.1.mlp.experts.8.up_proj.weight", (32, 64), "expert 8 out of range"),
        ("model.layers.1.mlp.experts.3.down_proj.weight", (64, 31), r"expected \(64, 32\), got \(64, 31\)"),
        ("model.layers.1.self_attn.q_proj.weight", (112, 64), "no parameter 'model.layers.1.self_attn.q_proj.weight'"),
    ],
)
def test_bad_checkpoint_tensor_is_named_with_the_reason(name, shape, message):
    model = DeepseekV3ForCausalLM(deepseek_config(), backend=cpu_backend())
    with pytest.raises(WeightLoadError, match=rf"'{name}'.*{message}"):
        model.load_weights([(name, torch.zeros(shape))])


def test_v2_style_routing_is_refused():
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        DeepseekV3ForCausalLM(deepseek_config(scoring_func="softmax", topk_method="greedy"), backend=cpu_backend())


def test_model_refuses_a_backend_without_mla_ops_at_construction(monkeypatch):
    backend = npu_backend(monkeypatch, "eager", RecordingTorchNpu())
    with pytest.raises(NotImplementedError, match="mla_attention.*npu backend does not have") as error:
        DeepseekV3ForCausalLM(deepseek_config(), backend=backend)
    assert "sinks" not in str(error.value)  # only the ops it calls


def test_decode_forward_traces_as_one_graph_and_matches_eager(tmp_path):
    """What the graph modes need (fullgraph, static shapes): the MoE experts' host read of their
    counts and the paged gathers stay inside opaque ops."""
    config = deepseek_config(num_hidden_layers=2)  # one dense layer, one MoE layer
    save_checkpoint(tmp_path, config)
    ours = PagedModel(load_ours(tmp_path, config), block_size=4)
    check_decode_traces_as_one_graph(ours, random_prompts([3, 9, 5], seed=8))
