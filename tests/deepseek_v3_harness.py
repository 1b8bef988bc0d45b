"""Tiny random DeepSeek-V3 configs and checkpoints, and a driver that runs our model over a paged
cache like the engine does, for the DeepSeek-V3 tests."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from executor.core.engine.step_inputs import ScheduledSequence, build_step_layout
from executor.core.types_.model_inputs import ModelInputs
from executor.model_loader.default_loader import safetensors_weights
from models.deepseek_v3 import DeepseekV3ForCausalLM
from module.attention import KVCacheLayer
from ops.attention_metadata import TorchMetadataBuilder, build_model_inputs

VOCAB = 256


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Matmuls this small run faster on one thread; extra threads only contend on a busy machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def deepseek_config(**overrides: object) -> transformers.DeepseekV3Config:
    """Three layers (the first dense), 8 routed experts in 4 groups, q_lora_rank set, no MTP module;
    overrides change any field."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,  # transformers' eager attention repeats K/V by heads // this
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        max_position_embeddings=128,
        num_nextn_predict_layers=0,
        initializer_range=0.1,  # peaked logits, so greedy choices are far from ties
        bos_token_id=None,
        eos_token_id=None,  # HF generate must not stop early
        pad_token_id=None,
        attn_implementation="eager",
    )
    settings.update(overrides)
    return transformers.DeepseekV3Config(**settings)


def random_hf_model(config: transformers.DeepseekV3Config, seed: int = 0) -> transformers.DeepseekV3ForCausalLM:
    """transformers' model with random weights, including the routers' score-correction biases and
    the linear biases (which transformers initialises to zero)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("bias"):
                tensor.normal_(0.0, 0.1)
    return model


def save_checkpoint(path: Path, config: transformers.DeepseekV3Config, seed: int = 0) -> torch.nn.Module:
    """Write a model folder for `config` (config.json + model.safetensors with DeepSeek's tensor
    names) and return transformers' model with the same weights.

    With config.num_nextn_predict_layers > 0 the folder holds the MTP modules too: their decoder
    blocks are the extra layers of a deeper random transformers model, whose forward runs only the
    first num_hidden_layers (so it is the main model, and model.model.layers[N + i] is MTP module
    i's block), plus random enorm/hnorm/eh_proj/shared_head.norm and each module's copies of the
    embedding and LM head, as released checkpoints carry them.
    """
    num_layers, num_mtp = config.num_hidden_layers, config.num_nextn_predict_layers or 0
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = num_layers + num_mtp
    model = random_hf_model(deeper, seed)
    model.save_pretrained(path)
    model.config.num_hidden_layers = num_layers
    tensors = load_file(str(path / "model.safetensors"))
    hidden = config.hidden_size
    for index in range(num_layers, num_layers + num_mtp):
        prefix = f"model.layers.{index}."
        tensors |= {
            prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
            prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
            prefix + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
            prefix + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return model


def load_ours(path: Path, config: transformers.DeepseekV3Config) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(config)
    filled = model.load_weights(safetensors_weights(path))
    assert filled == {name for name, _ in model.named_parameters()}
    return model.eval()


class PagedModel:
    """One of our models with NaN-filled caches (from each layer's spec) and a shuffled free list of
    blocks, driven like the engine: every step packed (TND), block tables of fixed width padded
    with the null block 0."""

    def __init__(self, model: torch.nn.Module, block_size: int, max_model_len: int = 128) -> None:
        self.model = model
        self.block_size = block_size
        num_blocks = 4 * max_model_len // block_size * 4
        for layer in (m for m in model.modules() if isinstance(m, KVCacheLayer)):
            spec = layer.kv_cache_spec()
            caches = {t.name: torch.full((num_blocks, block_size, *t.shape), float("nan")) for t in spec.tensors}
            layer.bind_kv_cache(caches, group_id=0)
        self.max_blocks_per_request = -(-max_model_len // block_size)
        self.free_blocks = random.Random(0).sample(range(1, num_blocks), num_blocks - 1)  # 0 is the null block

    def allocate(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // self.block_size)
        blocks, self.free_blocks = self.free_blocks[:num_blocks], self.free_blocks[num_blocks:]
        return blocks

    def blocks_for(self, blocks: list[int], num_tokens: int) -> list[int]:
        """The prefix of a request's blocks that covers num_tokens, as the KV cache manager hands them out."""
        return blocks[: -(-num_tokens // self.block_size)]

    def inputs(self, sequences: list[ScheduledSequence], pad_to: int = 0) -> ModelInputs:
        layout = build_step_layout(
            sequences, block_size=self.block_size, max_blocks_per_request=self.max_blocks_per_request
        )
        if pad_to:
            layout = layout.pad_to(pad_to)
        return build_model_inputs(layout, TorchMetadataBuilder(torch.device("cpu")))

    @torch.no_grad()
    def step(self, sequences: list[ScheduledSequence], pad_to: int = 0) -> torch.Tensor:
        """Logits of each sequence's last token (a decode step may be padded to `pad_to` rows)."""
        inputs = self.inputs(sequences, pad_to)
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        return self.model.compute_logits(hidden_states, inputs.logits_indices)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, pad_to: int = 0) -> list[list[int]]:
        """One packed prefill, then one batched decode step per token for all prompts together."""
        blocks = [self.allocate(len(prompt) + max_new_tokens) for prompt in prompts]
        sequences = [
            ScheduledSequence(p, 0, [self.blocks_for(b, len(p))]) for p, b in zip(prompts, blocks, strict=True)
        ]
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_tokens = self.step(sequences, pad_to if step else 0).argmax(-1).tolist()
            for output, token in zip(outputs, next_tokens, strict=True):
                output.append(token)
            num_tokens = [len(prompt) + step + 1 for prompt in prompts]  # after appending the new token
            sequences = [
                ScheduledSequence([token], total - 1, [self.blocks_for(request_blocks, total)])
                for token, total, request_blocks in zip(next_tokens, num_tokens, blocks, strict=True)
            ]
        return outputs


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in lengths]


@torch.no_grad()
def hf_last_logits(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([prompt])).logits[0, -1]


@torch.no_grad()
def hf_generate(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()
