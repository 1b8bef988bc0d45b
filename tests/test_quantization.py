"""Quantized checkpoints and model_config.quantization against transformers + compressed-tensors on
the same file, and the arithmetic against compressed-tensors' own.

Each scheme is judged teacher-forced: the last-position logits of a batch of prompts (every prompt
fed the same tokens to both), their top-1 agreement and the mean KL between the two distributions.
Tolerances: fp32 logits within 1e-5 of transformers (the two differ by summation order only: the
int8 matmul is exact, the rest is the same fp32 arithmetic), bf16 within 3e-2 (bf16 rounding). Where
activations are quantized per token at run time, that summation order (ours packs the prompts into
one GEMM, transformers runs each alone: 1e-7 apart here) can move one activation across an int8
rounding boundary, a step of max|x| / 127.5: one prompt's logits moved 2.2e-3 on a Xeon with AMX and
none on an AVX-512 EPYC. So there one prompt may be off by up to DYNAMIC_FLIP_ATOL, the rest not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig

from executor.core.config import ConfigError, build_config
from executor.model_loader.quantization_config import QuantizationRequest, online_scheme, read_quantization
from executor.offline.dataset import PromptRecord
from executor.offline.quantize_checkpoint import quantize_checkpoint, quantized_model
from executor.types_.quant_scheme import CHANNEL, GROUP, INT, QuantArgs, QuantizationPlan, SchemeGroup
from models.llama.model import LlamaForCausalLM as OurLlama
from module.quantization_pass import quantize_model
from module.quantized import QuantizationError
from ops import quant_math
from ops.quantized_linear import Int8ScaledLinear
from tests.backends import cpu_backend
from tests.conftest import save_tiny_llama
from tests.engine_harness import engine_prefill_logits, make_inference

PROMPTS = [[1, 5, 9, 20, 30, 40, 7], [1, 7, 3], [1, 100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 250]]
FP32_ATOL = 1e-5
DYNAMIC_FLIP_ATOL = 1e-2


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory) -> Path:
    """A random Llama whose every dim is a multiple of 128, for FP8's 128x128 blocks."""
    path = tmp_path_factory.mktemp("wide_llama")
    return save_tiny_llama(path, hidden_size=128, intermediate_size=256, num_key_value_heads=4, head_dim=32)


@torch.no_grad()
def hf_last_logits(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([model(torch.tensor([ids])).logits[0, -1].float() for ids in PROMPTS])


def ours_last_logits(model_dir: Path, dtype: str = "float32", **model_config) -> torch.Tensor:
    return engine_prefill_logits(make_inference(model_dir, dtype, model_config), PROMPTS)


def assert_teacher_forced_agreement(
    ours: torch.Tensor, reference: torch.Tensor, atol: float, one_prompt_atol: float | None = None
) -> None:
    """`one_prompt_atol`: the bound of the one prompt (if any) past `atol`, for run-time activation scales."""
    kl = F.kl_div(F.log_softmax(ours, -1), F.log_softmax(reference, -1), log_target=True, reduction="batchmean")
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert kl.item() < 1e-4
    if one_prompt_atol is None:
        torch.testing.assert_close(ours, reference, atol=atol, rtol=0)
        return
    per_prompt = (ours - reference).abs().amax(-1)
    assert (per_prompt > atol).sum() <= 1 and per_prompt.max() <= one_prompt_atol, per_prompt


@pytest.mark.parametrize(
    ("scheme", "static"),
    [
        ("w8a8", False),
        ("w8a8", True),
        ("w4a16_g32", False),
        ("w8a16_g32", False),
        ("w4a8_g32", False),
        ("fp8", False),
        ("fp8", True),
        ("w8a8", "naive-quantized"),
    ],
)
def test_a_compressed_tensors_checkpoint_gives_transformers_logits(scheme, static, tiny_llama_dir, tmp_path):
    """`static` True: calibrated per-tensor input scales; a format name: that format instead of the inferred one."""
    quantization_format = static if isinstance(static, str) else None
    checkpoint = quantize_checkpoint(
        tiny_llama_dir,
        tmp_path / "q",
        scheme,
        static=static is True,
        calibration=PROMPTS,
        quantization_format=quantization_format,
    )
    if quantization_format is not None:
        assert (
            json.loads((checkpoint / "config.json").read_text())["quantization_config"]["format"] == quantization_format
        )
    reference = hf_last_logits(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval())
    unquantized = hf_last_logits(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval())
    ours = ours_last_logits(checkpoint)
    dynamic_int8 = scheme in ("w8a8", "w4a8_g32") and static is not True
    assert_teacher_forced_agreement(ours, reference, FP32_ATOL, DYNAMIC_FLIP_ATOL if dynamic_int8 else None)
    assert (ours - unquantized).abs().max() > 10 * FP32_ATOL  # the scheme did change the model


@pytest.mark.parametrize(("scheme", "fixture"), [("w4a16_asym_g32", "tiny_llama_dir"), ("fp8_block", "wide_llama_dir")])
def test_checkpoints_transformers_cannot_load_match_compressed_tensors_own_decompression(
    scheme, fixture, request, tmp_path
):
    """transformers 5.24 refuses pack-quantized zero points (it expects them unpacked) and 128x128
    blocks need dims it has no tiny model for: the reference is compressed-tensors compressing
    and decompressing the same scheme in memory."""
    base = request.getfixturevalue(fixture)
    checkpoint = quantize_checkpoint(base, tmp_path / "q", scheme)
    model = quantized_model(base, scheme)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressor.decompress_model(model)
    assert_teacher_forced_agreement(ours_last_logits(checkpoint), hf_last_logits(model), FP32_ATOL)


@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp8"])
def test_mx_checkpoints_give_transformers_bf16_logits(scheme, tiny_llama_dir, tmp_path):
    """transformers decompresses MX weights into bf16 only, so both run in bf16."""
    checkpoint = quantize_checkpoint(tiny_llama_dir, tmp_path / "q", scheme)
    reference = hf_last_logits(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval())
    assert_teacher_forced_agreement(ours_last_logits(checkpoint, "bfloat16"), reference, 3e-2)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16_g32", "w4a16_asym_g32", "fp8", "w4a8_g32"])
def test_quantizing_at_load_equals_running_the_written_checkpoint(scheme, tiny_llama_dir, tmp_path):
    """model_config.quantization rounds to nearest with ops/quant_math.py; the script writes with
    compressed-tensors' calculate_qparams: the two give the same model."""
    checkpoint = quantize_checkpoint(tiny_llama_dir, tmp_path / "q", scheme)
    at_load = ours_last_logits(tiny_llama_dir, quantization=scheme)
    torch.testing.assert_close(at_load, ours_last_logits(checkpoint), atol=1e-6, rtol=0)


def test_int8_accumulation_is_exact_and_activations_quantize_as_compressed_tensors_does():
    torch.manual_seed(0)
    x = torch.randn(9, 64) * torch.logspace(-2, 1, 64)
    weight = torch.randn(48, 64)
    args = QuantArgs(8, INT, CHANNEL)
    values, scale, _ = quant_math.quantize_weight(weight, args)
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale, layer.scheme = values, scale, online_scheme("w8a8", "test")
    method = Int8ScaledLinear()
    method.process_weights(layer)
    x_values, x_scale = quant_math.quantize_int8_per_token(x)
    accumulated = torch._int_mm(x_values, layer.int8_matmul_weight)
    assert torch.equal(accumulated.long(), x_values.long() @ values.long().t())
    ct_args = preset_name_to_scheme("W8A8", ["Linear"]).input_activations
    ct_scale, ct_zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), ct_args)
    ct_dequantized = fake_quantize(x, ct_scale, ct_zero, ct_args)
    torch.testing.assert_close(x_values.float() * x_scale, ct_dequantized, atol=0, rtol=0)
    expected = quant_math.int8_scaled_mm_reference(x_values, x_scale, values, scale, None, torch.float32)
    torch.testing.assert_close(method.apply(layer, x, None), expected, atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 12),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([8, 16, 32]),
    num_bits=st.sampled_from([4, 8]),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_to_nearest_equals_compressed_tensors_qparams(rows, groups, group_size, num_bits, symmetric, seed):
    weight = torch.randn(rows, groups * group_size, generator=torch.Generator().manual_seed(seed))
    ours = QuantArgs(num_bits, INT, GROUP, symmetric, group_size)
    preset = "W4A16" if num_bits == 4 else "W8A16"
    theirs = preset_name_to_scheme(preset if symmetric else "W4A16_ASYM", ["Linear"]).weights
    theirs.num_bits, theirs.group_size = num_bits, group_size
    scale, zero_point = quant_math.qparams(*quant_math.weight_groups(weight, ours), ours)
    ct_scale, ct_zero = calculate_qparams(*quant_math.weight_groups(weight, ours), theirs)
    torch.testing.assert_close(scale, ct_scale, atol=0, rtol=0)
    torch.testing.assert_close(zero_point.to(ct_zero.dtype), ct_zero, atol=0, rtol=0)


def test_the_most_specific_target_wins_and_ignore_beats_every_target():
    w8a8, w4a16 = online_scheme("w8a8", "k"), online_scheme("w4a16", "k")
    plan = QuantizationPlan(
        groups=(
            SchemeGroup("by_class", ("Linear",), w8a8),
            SchemeGroup("by_regex", (r"re:.*mlp\..*",), w4a16),
        ),
        ignore=("lm_head", r"re:.*layers\.3\..*"),
        format="int-quantized",
    )
    assert plan.scheme_for("model.layers.0.self_attn.q_proj") == w8a8
    assert plan.scheme_for("model.layers.0.mlp.down_proj") == w4a16
    assert plan.scheme_for("model.layers.3.mlp.down_proj") is None
    assert plan.scheme_for("lm_head") is None
    assert plan.scheme_for("model.embed_tokens", class_name="Embedding") is None


def test_fused_parts_with_different_schemes_are_refused_naming_the_layer(tiny_llama_dir):
    plan_config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head", r"re:.*k_proj$"],
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}}},
    }
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.quantization_config = plan_config
    plan = read_quantization(config, QuantizationRequest(), "config.json")
    backend = cpu_backend()
    with pytest.raises(
        QuantizationError, match="model.layers.0.self_attn.qkv_proj runs model.layers.0.self_attn.q_proj"
    ):
        quantize_model(OurLlama(config, backend=backend), plan, backend, torch.float32)


def test_cann_recipes_online_mxfp8_keys_quantize_as_mxfp8_does_skipping_the_ignored_layers(tiny_llama_dir):
    mxfp8 = make_inference(tiny_llama_dir, model_config={"quantization": "mxfp8"})
    params = {"enable_online_mxfp8_quantization": True, "online_mxfp8_ignored_layers": ["model.layers.1"]}
    cann = make_inference(tiny_llama_dir, model_config={"custom_params": params})
    modules = dict(cann.engine.worker.model.named_modules())
    assert modules["model.layers.0.mlp.down_proj"].scheme.kind == "mxfp8"
    assert getattr(modules["model.layers.1.mlp.down_proj"], "scheme", None) is None
    assert getattr(modules["lm_head"], "scheme", None) is None
    everything = make_inference(
        tiny_llama_dir, model_config={"custom_params": params | {"online_mxfp8_ignored_layers": []}}
    )
    torch.testing.assert_close(
        engine_prefill_logits(everything, PROMPTS), engine_prefill_logits(mxfp8, PROMPTS), atol=0, rtol=0
    )


def test_the_summary_names_each_layer_kinds_scheme_and_the_weight_and_kv_bytes(tiny_llama_dir):
    plain = make_inference(tiny_llama_dir).engine.worker
    quantized = make_inference(tiny_llama_dir, model_config={"quantization": "w8a8"}).engine.worker
    assert quantized.layer_schemes["down_proj"].startswith("weights int8 per channel, activations int8 per token")
    assert quantized.layer_schemes["lm_head"].startswith("unquantized")
    assert plain.layer_schemes["down_proj"].startswith("unquantized")
    assert quantized.weight_bytes < plain.weight_bytes
    assert quantized.kv_cache_bytes_per_token() == plain.kv_cache_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_enable_hadamard_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match="enable_hadamard.*online Hadamard transform of attention inputs"):
        build_config({"model_config": {"enable_hadamard": True}}, source="run.yaml")


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16_g32"])
def test_every_prompt_position_scores_as_transformers_does_under_the_scheme(scheme, tiny_llama_dir, tmp_path):
    """Teacher forced at every position (prompt logprobs): the given token's logprob within 1e-4 of
    transformers' on the same checkpoint (W8A8's run-time activation scales: but at one position,
    within DYNAMIC_FLIP_ATOL there: the module docstring says why), and the same top-1 token at every
    position."""
    checkpoint = quantize_checkpoint(tiny_llama_dir, tmp_path / "q", scheme)
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    records = [
        PromptRecord(id=f"p{i}", prompt_token_ids=ids, sampling_overrides={"prompt_logprobs": 1})
        for i, ids in enumerate(PROMPTS)
    ]
    result = make_inference(checkpoint).generate(records, None)
    differences = []
    for request in result.requests:
        with torch.no_grad():
            expected = hf_model(torch.tensor([request.prompt_token_ids])).logits[0].float().log_softmax(-1)
        for position, entry in enumerate(request.prompt_logprobs):
            differences.append(abs(entry.logprob - expected[position, entry.token_id].item()))
            assert entry.top_token_ids[0] == expected[position].argmax().item()
    past = [difference for difference in differences if difference >= 1e-4]
    assert len(past) <= (1 if scheme == "w8a8" else 0) and max(differences) < DYNAMIC_FLIP_ATOL, past


def test_default_model_w4a16_decode_through_the_few_row_kernel_equals_transformers_on_the_same_weights(smollm2_dir):
    """Batch 1 decode runs the CPU's 4-bit kernel (<= 8 rows); transformers runs the same
    round-to-nearest weights dequantized: the same greedy tokens."""
    scheme = online_scheme("w4a16_g64", "test").weights
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            values, scale, zero_point = quant_math.quantize_weight(module.weight.data, scheme)
            module.weight.data = quant_math.dequantize_weight(values, scale, zero_point, scheme, torch.float32)
    prompt = [1, 504, 3458, 282, 4649, 314]
    inference = make_inference(smollm2_dir, model_config={"quantization": "w4a16_g64"}, max_new_tokens=12, batch_size=1)
    (request,) = inference.generate([PromptRecord(id="p", prompt_token_ids=prompt)], None).requests
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt) :]
    assert request.output_token_ids == expected.tolist()[: len(request.output_token_ids)]
    assert len(request.output_token_ids) >= 8
