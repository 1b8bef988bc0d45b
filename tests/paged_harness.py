"""Driving any of our models over a paged KV cache as the engine does, next to transformers, for the
parity tests of every model family: NaN-filled caches built from each layer's spec, scattered
blocks, packed (TND) steps, and transformers' outputs for each prompt alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from executor.core.engine.step_inputs import ScheduledSequence, build_step_layout
from executor.core.types_.model_inputs import ModelInputs
from executor.model_loader.default_loader import safetensors_weights
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


def load_ours(model_cls: type[torch.nn.Module], path: Path, config: object) -> torch.nn.Module:
    """Our model for `config` with the weights of model folder `path`; every parameter must be filled."""
    model = model_cls(config)
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
