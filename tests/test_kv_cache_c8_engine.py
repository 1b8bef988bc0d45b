"""C8 through the whole engine: `model_config.quantization: c8` (and w8a8+c8) on a tiny random Llama and
a tiny DeepSeek-V3 (MLA's latent cache), and a checkpoint whose compressed-tensors config carries a
static kv_cache_scheme with k_scale / v_scale tensors.

The reference for each run is the same C8 scheme in plain torch: the engine with the CPU kernels
kept out (the backend record then runs ops/torch_ref.py for every op). Greedy tokens must be equal.
The KV pool is sized from the int8 specs: bytes per token per layer fall from 2 x Hkv x D x 4 (fp32)
to 2 x Hkv x (D + 4) (int8 values and one fp32 scale per token and head).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.offline.offline_inference import OfflineInference
from ops import cpu_kernels
from tests.deepseek_v3_harness import save_checkpoint
from tests.engine_harness import ENGINE_CONFIG, make_inference, token_records
from tests.factories import deepseek_config, tiny_tokenizer
from tests.test_engine_contract import make_prompts

BLOCK_SIZE = 16  # make_inference's
PROMPTS = make_prompts([5, 17, 33, 8], seed=11)


def greedy(inference: OfflineInference, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [request.output_token_ids for request in inference.generate(token_records(prompts)).requests]


def c8_inference(
    model_dir: Path, quantization: str, extension: bool, monkeypatch, model_config: dict | None = None, **scheduler
) -> OfflineInference:
    """The engine with `quantization`, and the CPU kernels only where `extension`."""
    with monkeypatch.context() as patch:
        if not extension:
            patch.setattr(cpu_kernels, "extension", lambda: None)
        model_config = (model_config or {}) | ({"quantization": quantization} if quantization else {})
        return make_inference(model_dir, model_config=model_config, **scheduler)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_deepseek_v3_c8")
    save_checkpoint(path, deepseek_config(**ENGINE_CONFIG))
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("quantization", ["c8", "w8a8+c8"])
def test_llama_c8_greedy_equals_the_torch_reference_of_the_same_scheme(tiny_llama_dir, quantization, monkeypatch):
    kernels = c8_inference(tiny_llama_dir, quantization, True, monkeypatch)
    reference = c8_inference(tiny_llama_dir, quantization, False, monkeypatch)
    assert type(kernels.engine.backend.attention) is not type(reference.engine.backend.attention)
    assert greedy(kernels) == greedy(reference)


def test_llama_c8_holds_int8_kv_and_a_scale_per_token_and_head(tiny_llama_dir, monkeypatch):
    plain = make_inference(tiny_llama_dir)
    c8 = c8_inference(tiny_llama_dir, "c8", True, monkeypatch)
    layers, kv_heads, head_dim = 2, 2, 16  # tests/conftest.py's tiny Llama
    assert plain.engine.worker.kv_cache_bytes_per_block(BLOCK_SIZE) == layers * BLOCK_SIZE * 2 * kv_heads * head_dim * 4
    c8_bytes = c8.engine.worker.kv_cache_bytes_per_block(BLOCK_SIZE)
    assert c8_bytes == layers * BLOCK_SIZE * 2 * kv_heads * (head_dim + 4)
    layer = next(iter(c8.engine.worker.kv_cache_layers.values()))
    caches = layer.kv_caches()
    assert caches["key"].dtype == torch.int8 and caches["key_scale"].dtype == torch.float32
    assert caches["key_scale"].shape == caches["key"].shape[:-1]


def test_llama_c8_outputs_stay_close_to_the_unquantized_cache(tiny_llama_dir, monkeypatch):
    """Not equal (int8 rounding), but most greedy tokens agree on a random tiny model."""
    plain, c8 = greedy(make_inference(tiny_llama_dir)), greedy(c8_inference(tiny_llama_dir, "c8", True, monkeypatch))
    agreeing = sum(a == b for ours, theirs in zip(c8, plain, strict=True) for a, b in zip(ours, theirs, strict=True))
    print(f"C8 vs unquantized cache: {agreeing} of {sum(map(len, plain))} greedy tokens equal")
    assert c8[0][:4] == plain[0][:4]


def test_deepseek_v3_c8_latent_cache_runs_and_equals_the_torch_reference(deepseek_dir, monkeypatch):
    deepseek = {"model_name": "deepseek_v3"}
    kernels = c8_inference(deepseek_dir, "c8", True, monkeypatch, deepseek)
    reference = c8_inference(deepseek_dir, "c8", False, monkeypatch, deepseek)
    assert greedy(kernels) == greedy(reference)
    config = deepseek_config(**ENGINE_CONFIG)
    width, layers = config.kv_lora_rank + config.qk_rope_head_dim, config.num_hidden_layers
    plain = make_inference(deepseek_dir, model_config=deepseek)
    assert plain.engine.worker.kv_cache_bytes_per_block(BLOCK_SIZE) == layers * BLOCK_SIZE * width * 4
    assert kernels.engine.worker.kv_cache_bytes_per_block(BLOCK_SIZE) == layers * BLOCK_SIZE * (width + 4)


def test_c8_prefix_cache_hits_give_the_outputs_of_no_hits(tiny_llama_dir, monkeypatch):
    """Every key is read back from the int8 cache, a step's own too: a prefix hit changes nothing."""
    shared = make_prompts([40], seed=12)[0]
    prompts = [shared + tail for tail in make_prompts([3, 9, 1], seed=13)]
    hits = c8_inference(tiny_llama_dir, "c8", True, monkeypatch, batch_size=1)
    no_hits = c8_inference(tiny_llama_dir, "c8", True, monkeypatch, batch_size=1, enable_prefix_caching=False)
    assert greedy(hits, prompts) == greedy(no_hits, prompts)
    assert hits.engine.kv_cache_manager.num_hit_tokens >= 2 * 32  # two later prompts hit two blocks each


def test_c8_preemption_gives_the_large_pool_outputs(tiny_llama_dir, monkeypatch):
    prompts = make_prompts([30, 12, 25, 7, 18, 40], seed=5)
    large = c8_inference(tiny_llama_dir, "c8", True, monkeypatch, batch_size=6)
    small = c8_inference(tiny_llama_dir, "c8", True, monkeypatch, batch_size=6, num_blocks=10, max_model_len=128)
    small_result = small.generate(token_records(prompts))
    assert small_result.summary["preemptions"] > 1
    assert [r.output_token_ids for r in small_result.requests] == greedy(large, prompts)


def write_static_c8_checkpoint(base_dir: Path, out_dir: Path, scale: float) -> None:
    """base_dir's model with compressed-tensors' static per-tensor int8 kv_cache_scheme: config.json's
    quantization_config and a k_scale / v_scale [1] on every model.layers.N.self_attn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in base_dir.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            (out_dir / file.name).write_bytes(file.read_bytes())
    config = json.loads((base_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False},
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(base_dir / "model.safetensors")
    for layer in range(config["num_hidden_layers"]):
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([scale])
    save_file(tensors, out_dir / "model.safetensors")


def test_a_static_kv_cache_scheme_checkpoint_loads_its_scales_and_runs(tiny_llama_dir, tmp_path, monkeypatch):
    static_dir = tmp_path / "static_c8"
    write_static_c8_checkpoint(tiny_llama_dir, static_dir, scale=0.02)
    kernels = c8_inference(static_dir, "", True, monkeypatch)
    layer = next(iter(kernels.engine.worker.kv_cache_layers.values()))
    assert layer.kv_scheme is not None and not layer.kv_scheme.dynamic
    assert torch.equal(layer.k_scale, torch.full((2, 16), 0.02))
    assert set(layer.kv_caches()) == {"key", "value"}  # static scales are parameters, not cache tensors
    reference = c8_inference(static_dir, "", False, monkeypatch)
    assert greedy(kernels) == greedy(reference)
    layers, kv_heads, head_dim = 2, 2, 16
    assert kernels.engine.worker.kv_cache_bytes_per_block(BLOCK_SIZE) == layers * BLOCK_SIZE * 2 * kv_heads * head_dim
