"""Driving any of our models over a paged KV cache as the engine does, next to transformers, for the
parity tests of every model family: NaN-filled caches built from each layer's spec, scattered
blocks, packed (TND) steps, and transformers' outputs for each prompt alone; tiny random checkpoints
(the configs are tests/factories.py's); and the checks every family runs (check_*), which assert."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
import transformers

from executor.core.model_worker.bucket_padding import pad_step
from executor.model_loader.default_loader import safetensors_weights
from module.attention import KVCacheLayer
from module.recurrent import RecurrentStateLayer
from ops.attention.metadata import (
    ModelInputs,
    ScheduledSequence,
    TorchMetadataBuilder,
    build_model_inputs,
    build_step_layout,
)
from tests.backends import cpu_backend
from tests.factories import TINY_VOCAB

VOCAB = TINY_VOCAB  # the parity models' vocabulary (factories.PARITY_SETTINGS): random prompts draw from it


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Matmuls this small run faster on one thread; extra threads only contend on a busy machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def save_random_model(
    path: Path,
    model_cls: Callable[[transformers.PretrainedConfig], torch.nn.Module],
    config: transformers.PretrainedConfig,
    seed: int = 0,
    redraw: Mapping[str, tuple[float, float]] | None = None,
) -> torch.nn.Module:
    """transformers' model_cls(config) with random weights from `seed`, saved to `path` in its own
    format and returned (in eval mode) for reference. Parameters and buffers whose names end with a
    key of `redraw` are drawn again from normal(mean, std) (its value): those that transformers'
    init leaves constant (biases zero, norm weights one), so that each must load for parity."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            for suffix, (mean, std) in (redraw or {}).items():
                if name.endswith(suffix):
                    tensor.normal_(mean, std)
                    break
    model.save_pretrained(path)
    return model


def load_ours(model_cls: type[torch.nn.Module], path: Path, config: object) -> torch.nn.Module:
    """Our model for `config` with the weights of model folder `path`; every parameter must be filled."""
    model = model_cls(config, backend=cpu_backend(torch.get_default_dtype()))
    filled = model.load_weights(safetensors_weights(path))
    assert filled == {name for name, _ in model.named_parameters()}
    return model.eval()


class PagedModel:
    """One of our models with NaN-filled caches (from each layer's spec) and a shuffled free list of
    blocks, driven like the engine: every step packed (TND), block tables of fixed width padded
    with the null block 0. A hybrid model's recurrent layers (linear attention) form group 1, whose
    NaN-filled states have a slot per block id: a request's state slot is its first block's id."""

    def __init__(self, model: torch.nn.Module, block_size: int, max_model_len: int = 128) -> None:
        self.model = model
        self.block_size = block_size
        num_blocks = 4 * max_model_len // block_size * 4
        self.state_groups: tuple[int, ...] = ()
        for layer in (m for m in model.modules() if isinstance(m, KVCacheLayer)):
            spec = layer.kv_cache_spec()
            caches = {
                t.name: torch.full(spec.allocation_shape(t, num_blocks, block_size, num_blocks), float("nan"))
                for t in spec.tensors
            }
            layer.bind_kv_cache(caches, group_id=1 if spec.is_recurrent else 0)
            self.state_groups = (1,) if spec.is_recurrent else self.state_groups
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
        if self.state_groups:  # each request's state slot: its first block's id
            sequences = [
                dataclasses.replace(seq, block_ids=[*seq.block_ids, seq.block_ids[0][:1]]) for seq in sequences
            ]
        layout = build_step_layout(
            sequences,
            block_size=self.block_size,
            max_blocks_per_request=self.max_blocks_per_request,
            state_groups=self.state_groups,
        )
        if pad_to:
            layout = pad_step(layout, pad_to)
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


def parity_models(
    path: Path,
    config: transformers.PretrainedConfig,
    save_checkpoint: Callable[[Path, transformers.PretrainedConfig], torch.nn.Module],
    load_ours: Callable[[Path, transformers.PretrainedConfig], torch.nn.Module],
    block_size: int,
) -> tuple[torch.nn.Module, PagedModel]:
    """On the CPU backend: transformers' model that save_checkpoint writes to `path` for `config`,
    and ours loaded from that folder over a PagedModel with blocks of `block_size`."""
    hf_model = save_checkpoint(path, config)
    return hf_model, PagedModel(load_ours(path, config), block_size)


def random_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in lengths]


@torch.no_grad()
def hf_last_logits(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([prompt])).logits[0, -1]


@torch.no_grad()
def hf_generate(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    # The mask given, so that no prompt token is taken for padding (a config whose pad_token_id is an int).
    out = hf_model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(prompt) :].tolist()


def assert_last_logits_match(
    hf_model: torch.nn.Module, prompts: list[list[int]], logits: torch.Tensor, tolerance: float
) -> None:
    """Row i of `logits` is transformers' last-token logits for prompts[i] alone, to max-abs-diff `tolerance`."""
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= tolerance


def max_prefill_diff(hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]]) -> float:
    """The largest |ours - transformers'| over the last-token logits of `prompts` prefilled packed."""
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


def check_prefill_logits(
    hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]], tolerance: float
) -> None:
    """The prompts prefilled packed in one step: one row of logits each, transformers' for that prompt alone."""
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    assert logits.shape == (len(prompts), hf_model.config.get_text_config().vocab_size)
    assert_last_logits_match(hf_model, prompts, logits, tolerance)


def check_cached_prefix(
    hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]], splits: Sequence[int], tolerance: float
) -> None:
    """Each prompt's first `split` tokens prefilled in one packed step, the rest in the next over that
    cached prefix: the last logits are transformers' on the whole prompt."""
    blocks = [ours.allocate(len(p)) for p in prompts]
    ours.step([ScheduledSequence(p[:s], 0, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    logits = ours.step([ScheduledSequence(p[s:], s, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    assert_last_logits_match(hf_model, prompts, logits, tolerance)


def check_batched_greedy(
    hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]], max_new_tokens: int, pad_to: int = 0
) -> None:
    """PagedModel.greedy over all prompts together (decode steps padded to `pad_to` rows, as a graph
    would run them) gives each prompt transformers' generate() for that prompt alone."""
    outputs = ours.greedy(prompts, max_new_tokens, pad_to=pad_to)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_generate(hf_model, prompt, max_new_tokens)


def check_decode_traces_as_one_graph(ours: PagedModel, prompts: list[list[int]]) -> None:
    """What the graph modes need (fullgraph, static shapes): after a packed prefill, a decode step
    padded to 4 rows compiles as one graph and gives eager's hidden states. A recurrent layer's
    states, which the step advances, are put back before the eager run."""
    blocks = [ours.allocate(len(p) + 2) for p in prompts]
    tokens = ours.step([ScheduledSequence(p, 0, [b]) for p, b in zip(prompts, blocks, strict=True)]).argmax(-1)
    decode = [ScheduledSequence([t], len(p), [b]) for t, p, b in zip(tokens.tolist(), prompts, blocks, strict=True)]
    inputs = ours.inputs(decode, pad_to=4)
    states = [t for m in ours.model.modules() if isinstance(m, RecurrentStateLayer) for t in m.kv_caches().values()]
    before = [state.clone() for state in states]
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    compiled = torch.compile(ours.model, backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        traced = compiled(*inputs.forward_args())
        for state, saved in zip(states, before, strict=True):
            state.copy_(saved)
        eager = ours.model(*inputs.forward_args())  # writes the same cache entries to the same slots again
    torch._dynamo.reset()
    assert counter.frame_count == 1
    torch.testing.assert_close(traced, eager)


class PagedParityTests:
    """The parity tests every family runs on its module's `models` fixture ((transformers' model, our
    PagedModel) per config): a test module subclasses this as TestPagedParity, changing the prompt
    lengths and step counts where its family needs others (longer than its sliding window, say)."""

    tolerance = 1e-4  # fp32 logits, max-abs-diff
    prefill_prompt_lens = (5, 17, 1, 9, 12)
    prefix_prompt_lens, prefix_splits = (13, 8), (7, 3)
    decode_prompt_lens = (3, 11, 6, 1, 15, 8)
    max_new_tokens = 16
    decode_pad_to = 8  # decode steps padded to a bucket of 8 rows, as a graph would run them (0: unpadded)

    def test_packed_prefill_logits_match_hf_per_prompt(self, models):
        hf_model, ours = models
        check_prefill_logits(hf_model, ours, random_prompts(self.prefill_prompt_lens, seed=1), self.tolerance)

    def test_prefill_over_a_cached_prefix_matches_hf_on_the_whole_prompt(self, models):
        hf_model, ours = models
        prompts = random_prompts(self.prefix_prompt_lens, seed=2)
        check_cached_prefix(hf_model, ours, prompts, self.prefix_splits, self.tolerance)

    def test_batched_greedy_decoding_matches_hf_generate_per_prompt(self, models):
        hf_model, ours = models
        prompts = random_prompts(self.decode_prompt_lens, seed=3)
        check_batched_greedy(hf_model, ours, prompts, self.max_new_tokens, pad_to=self.decode_pad_to)


class RoutingTieTests:
    """For MoE families: the module's `tied_routing_models` fixture is a pair whose routers score
    experts equally at the top-k cut; ours must break those ties as transformers does, in prefill and
    in decode. A test module subclasses this as TestRoutingTies."""

    tolerance = 1e-4
    tie_prompt_lens = (7, 4, 10)

    def test_routing_ties_break_as_in_transformers(self, tied_routing_models):
        hf_model, ours = tied_routing_models
        prompts = random_prompts(self.tie_prompt_lens, seed=4)
        check_prefill_logits(hf_model, ours, prompts, self.tolerance)
        check_batched_greedy(hf_model, ours, prompts, 8)
