"""Quantized routed experts: the int8 op against the plain form of the scheme, the stacked layer's
loading and cutting, the router refusal, and gpt-oss's MXFP4 experts against transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from executor.model_loader.quantization_config import QuantizationRequest, read_quantization
from executor.types_.quant_scheme import LinearScheme, QuantArgs, QuantizationPlan, SchemeGroup
from module.moe import FusedExperts, SoftmaxTopkRouter, SparseMoeBlock
from module.parallel_group import ParallelGroup
from module.quantization_pass import quantize_model
from module.quantized import QuantizationError
from ops import quant_math, torch_ref
from ops.linear_method import process_linear_weights
from ops.quantized_experts import DequantizedExperts, Int8Experts, fake_quantized_experts
from tests.backends import cpu_backend
from tests.engine_harness import engine_prefill_logits, make_inference
from tests.factories import gpt_oss_config, tiny_tokenizer

W8A8 = LinearScheme(QuantArgs(8), QuantArgs(8, strategy="token", dynamic=True))
W4A16_G8 = LinearScheme(QuantArgs(4, strategy="group", group_size=8, symmetric=False))
TOKEN_INT8 = QuantArgs(8, strategy="token", dynamic=True)


def routed(tokens: int = 12, experts: int = 4, hidden: int = 16, top_k: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(tokens, hidden, generator=generator)
    topk_ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=generator)
    return hidden_states, topk_weights, topk_ids


def test_int8_experts_equal_the_fake_quantized_plain_form():
    """torch._int_mm per expert, per-token activations: the plain form (dequantized int8 weights,
    fake-quantized inputs) to fp32 noise (measured 5e-7)."""
    hidden_states, topk_weights, topk_ids = routed()
    generator = torch.Generator().manual_seed(1)
    gate_up = torch.randn(4, 2 * 8, 16, generator=generator) * 0.2
    down = torch.randn(4, 16, 8, generator=generator) * 0.2
    quantized = [[quant_math.quantize_weight(w, QuantArgs(8))[:2] for w in stack] for stack in (gate_up, down)]
    values = [torch.stack([v for v, _ in q]) for q in quantized]
    scales = [torch.stack([s for _, s in q]) for q in quantized]
    dense = [(v.float() * s) for v, s in zip(values, scales, strict=True)]
    ours = torch_ref.moe_experts_int8(
        hidden_states, topk_weights, topk_ids,
        values[0].transpose(1, 2).contiguous(), scales[0][..., 0],
        values[1].transpose(1, 2).contiguous(), scales[1][..., 0],
    )  # fmt: skip
    plain = fake_quantized_experts(hidden_states, topk_weights, topk_ids, *dense, TOKEN_INT8, None, None)
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-5)
    unquantized = torch_ref.moe_experts(hidden_states, topk_weights, topk_ids, gate_up, down)
    assert (unquantized - ours).abs().max() > 1e-3  # the weights were rounded


def quantized_experts(scheme: LinearScheme, tp: ParallelGroup | None = None) -> FusedExperts:
    experts = FusedExperts(4, 16, 16, tp or ParallelGroup(), backend=cpu_backend())
    method = Int8Experts() if scheme is W8A8 else DequantizedExperts()
    experts.set_scheme(scheme, method, torch.float32, at_load=False)
    return experts


def test_stacked_experts_load_each_experts_tensors_and_dequantize_to_the_rounded_weights():
    experts = quantized_experts(W4A16_G8)
    generator = torch.Generator().manual_seed(2)
    originals = {}
    for expert in range(4):
        for projection, shape in (("gate_proj", (16, 16)), ("up_proj", (16, 16)), ("down_proj", (16, 16))):
            weight = torch.randn(*shape, generator=generator)
            values, scale, zero_point = quant_math.quantize_weight(weight, W4A16_G8.weights)
            originals[expert, projection] = quant_math.dequantize_weight(
                values, scale, zero_point, W4A16_G8.weights, torch.float32
            )
            for tensor, value in (("weight", values), ("weight_scale", scale), ("weight_zero_point", zero_point)):
                experts.load_expert_weight(value, expert, projection, tensor)
    DequantizedExperts().process_weights(experts)
    for expert in range(4):
        gate, up = experts.gate_up_proj[expert].chunk(2)
        torch.testing.assert_close(gate, originals[expert, "gate_proj"])
        torch.testing.assert_close(up, originals[expert, "up_proj"])
        torch.testing.assert_close(experts.down_proj[expert], originals[expert, "down_proj"])


RANK_1_OF_2 = ParallelGroup("moe_tp", rank=1, size=2)  # for building layers: no collective is made


def test_a_group_straddling_the_moe_tp_shard_is_one_line_naming_the_layer():
    """moe_tp 2 cuts I = 16 into 8 input features of down_proj: groups of 16 straddle it."""
    model = SparseMoeBlock(
        SoftmaxTopkRouter(16, 4, 2, True), FusedExperts(4, 16, 16, RANK_1_OF_2, backend=cpu_backend())
    )
    scheme = LinearScheme(QuantArgs(4, strategy="group", group_size=16))
    plan = QuantizationPlan(
        (SchemeGroup("g", ("Linear",), scheme),), ignore=("re:.*gate$",), format="pack-quantized", source="c.json"
    )
    with pytest.raises(QuantizationError, match=r"^c.json: layer experts \(.*\): a row-parallel shard of 8 input"):
        quantize_model(model, plan, cpu_backend(), torch.float32)


def test_a_plan_that_quantizes_a_router_is_refused_by_name():
    model = SparseMoeBlock(SoftmaxTopkRouter(16, 4, 2, True), FusedExperts(4, 16, 16, backend=cpu_backend()))
    plan = QuantizationPlan((SchemeGroup("g", ("Linear",), W8A8),), source="c.json")
    with pytest.raises(QuantizationError, match=r"^c.json: gate \(SoftmaxTopkRouter\) is a router"):
        quantize_model(model, plan, cpu_backend(), torch.float32)


def test_online_w8a8_quantizes_experts_at_load_and_runs_them_in_int8():
    """model_config.quantization's plan (routers ignored) rounds the float experts after loading."""
    model = torch.nn.Module()
    model.mlp = SparseMoeBlock(SoftmaxTopkRouter(16, 4, 2, True), FusedExperts(4, 16, 16, backend=cpu_backend()))
    generator = torch.Generator().manual_seed(3)
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    gate_up, down = model.mlp.experts.gate_up_proj.clone(), model.mlp.experts.down_proj.clone()
    plan = read_quantization(object(), QuantizationRequest("w8a8"), "x.yaml")
    layers = quantize_model(model, plan, cpu_backend(), torch.float32)
    assert [layer.name for layer in layers] == ["mlp.experts"]
    assert process_linear_weights(model) == ["Int8Experts"]
    hidden_states, _, _ = routed(hidden=16)
    weights, ids = model.mlp.gate(hidden_states)
    int8 = QuantArgs(8)

    def rounded(weight: torch.Tensor) -> torch.Tensor:
        return quant_math.dequantize_weight(*quant_math.quantize_weight(weight, int8), int8, torch.float32)

    dense = [torch.stack([rounded(w) for w in stack]) for stack in (gate_up, down)]
    plain = fake_quantized_experts(hidden_states, weights, ids, *dense, TOKEN_INT8, None, None)
    torch.testing.assert_close(model.mlp(hidden_states), plain, atol=1e-5, rtol=1e-5)


# -- gpt-oss's MXFP4 experts ---------------------------------------------------------------------------


def mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> gpt-oss's (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32]): our RTN
    (quant_math's MX scale and e2m1 rounding) packed as transformers' convert_moe_packed_tensors unpacks."""
    groups = weight.unflatten(-1, (-1, 32))
    scale = quant_math.mx_scale(groups.abs().amax(-1), QuantArgs(4, type="float", mx=True))
    values = quant_math.round_to_fp4(groups / scale.unsqueeze(-1))
    magnitudes = torch.tensor(quant_math.FP4_E2M1_VALUES)
    codes = (values.abs().unsqueeze(-1) == magnitudes).float().argmax(-1) + 8 * (values < 0)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (torch.log2(scale) + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint_matches_transformers_dequantizing_it(tmp_path):
    """Prefill logits over every prefix of two prompts: within 1e-4 of transformers loading the same
    file with Mxfp4Config(dequantize=True) (measured 3e-6)."""
    torch.manual_seed(0)
    config = gpt_oss_config(intermediate_size=64, hidden_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_blocks(tensors.pop(name).transpose(1, 2).contiguous())  # stored [E, K, N]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((tmp_path / "config.json").read_text())
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    prompts = [[5, 9, 20, 30, 40, 7], [7, 3, 12, 60]]
    sequences = [p[:end] for p in prompts for end in range(1, len(p) + 1)]
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    with torch.no_grad():
        reference = torch.stack([reference_model(torch.tensor([ids])).logits[0, -1] for ids in sequences])
    inference = make_inference(tmp_path, model_config={"model_name": "gpt_oss"})
    ours = torch.cat([engine_prefill_logits(inference, sequences[i : i + 5]) for i in range(0, len(sequences), 5)])
    print(f"gpt-oss mxfp4: max |ours - transformers| {(ours - reference).abs().max():.2e}")
    assert (ours - reference).abs().max().item() <= 1e-4
    with torch.no_grad():
        unquantized = torch.stack([model.eval()(torch.tensor([ids])).logits[0, -1] for ids in sequences])
    assert (unquantized - reference).abs().max().item() > 1e-2  # the experts were rounded to fp4
