"""Shared fixtures: tiny random Llama and Ministral model folders (HF format, with a word-level
tokenizer), a Llama subclass with Ministral's sliding-window layers, and the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from models.llama import LlamaForCausalLM as OurLlamaForCausalLM
from tests.factories import TINY_VOCAB, tiny_tokenizer
from tests.paged_harness import save_random_model


def save_tiny_llama(path: Path, seed: int = 0, **overrides: object) -> Path:
    """A random HF Llama (GQA, untied) saved as safetensors with a tokenizer: a complete model folder;
    `overrides` replace config fields."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    config.update(overrides)
    save_random_model(path, LlamaForCausalLM, config, seed)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test leaves the torch thread count as it found it: a script's main() sets its --threads
    for the process, and kernels sum in another order on fewer threads."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, fetched and converted on first use (test.sh does it up front)."""
    from executor.model_loader.default_model import ensure_default_model

    return ensure_default_model()


WINDOW = 8


class SlidingLlama(OurLlamaForCausalLM):
    """A test model: Llama layers where `config.layer_types` says so get a sliding window (as
    transformers' Ministral does), so the model mixes two cache kinds."""

    def __init__(self, hf_config: transformers.PretrainedConfig, **kwargs: object) -> None:
        hf_config.attention_bias = hf_config.mlp_bias = False  # Ministral's layers have no biases
        super().__init__(hf_config, **kwargs)
        for layer, layer_type in zip(self.model.layers, hf_config.layer_types, strict=True):
            if layer_type == "sliding_attention":
                layer.self_attn.attn.sliding_window = hf_config.sliding_window


@pytest.fixture(scope="session")
def ministral_dir(tmp_path_factory) -> Path:
    config = transformers.MinistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_ministral")
    transformers.MinistralForCausalLM(config).eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def kernels():
    """The CPU kernels' ops (ops/csrc), built once: where a compiler is present they must build."""
    from ops import cpu_kernels

    built = cpu_kernels.extension()
    assert built is not None, "the CPU kernels build where a compiler is present"
    return built
