"""The Llama decode forward traces as one dynamo graph (`fullgraph=True`, the `eager` backend).

Shown here: on the torch path the compiled decode equals eager, and decode steps whose longest KV
differs (crossing block boundaries) reuse the one graph, because the decode metadata's shapes depend
only on the number of rows. Through a stand-in of the NPU path (a fake torch_npu and torchair whose
ops are torch.library custom ops computing the torch reference) the graph-mode table (torchair FIA,
lengths as int64 tensors) traces with the same single graph and gives the torch path's output, and
the eager NPU table (host lists) traces too: no forward calls an import helper or breaks the graph.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import transformers

from models.llama import LlamaForCausalLM
from module.attention import Attention
from ops.attention.metadata import (
    AttentionMetadataBuilder,
    ModelInputs,
    ScheduledSequence,
    TorchMetadataBuilder,
    build_model_inputs,
    build_step_layout,
)
from ops.attention.npu import NpuMetadataBuilder
from ops.backend import Backend
from tests.backends import cpu_backend
from tests.factories import llama_config
from tests.npu_stand_ins import npu_backend, traceable_torch_npu, traceable_torchair

CPU = torch.device("cpu")
VOCAB, BLOCK_SIZE, NUM_BLOCKS, MAX_POSITIONS = 128, 4, 64, 64
PROMPT_LENS = [3, 11, 6]  # the longest KV crosses a block boundary during the decode steps
NUM_DECODE_STEPS = 3
NO_LIMIT = 2147483647

# ---------------------------------------------------------------------------------------------------
# The model, driven as the engine drives it.


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(autouse=True)
def clean_dynamo() -> Iterator[None]:
    """Every test starts and ends with a clean dynamo cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class PagedLlama:
    """Our Llama with HF's random weights, NaN-filled caches and scattered blocks, driven step by step:
    `model` on the backend under test, `reference` on the CPU's, sharing the weights and the caches."""

    def __init__(self, head_dim: int, backend: Backend) -> None:
        config = llama_config(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=head_dim,
            vocab_size=VOCAB,
            max_position_embeddings=MAX_POSITIONS,
        )
        torch.manual_seed(0)
        hf_model = transformers.LlamaForCausalLM(config).eval()
        self.model = LlamaForCausalLM(config, backend=backend).eval()
        self.reference = LlamaForCausalLM(config, backend=cpu_backend()).eval()
        for model in (self.model, self.reference):
            model.load_weights(hf_model.state_dict().items())
        layers = zip(*(modules_of(model, Attention) for model in (self.model, self.reference)), strict=True)
        for attention, reference_attention in layers:
            shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, head_dim)
            caches = {"key": torch.full(shape, float("nan")), "value": torch.full(shape, float("nan"))}
            attention.bind_kv_cache(caches, group_id=0)
            reference_attention.bind_kv_cache(caches, group_id=0)
        free = random.Random(0).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)  # block 0 is the null block
        blocks_each = -(-(max(PROMPT_LENS) + NUM_DECODE_STEPS) // BLOCK_SIZE)
        self.blocks = [free[i * blocks_each : (i + 1) * blocks_each] for i in range(len(PROMPT_LENS))]
        generator = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENS]
        self.num_tokens = [0] * len(PROMPT_LENS)

    def inputs(self, sequences: list[ScheduledSequence], builder: AttentionMetadataBuilder) -> ModelInputs:
        max_blocks = -(-MAX_POSITIONS // BLOCK_SIZE)
        layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=max_blocks)
        return build_model_inputs(layout, builder)

    @torch.no_grad()
    def prefill(self) -> list[int]:
        """The prompts on the torch path, eagerly; returns each prompt's greedy next token."""
        sequences = [
            ScheduledSequence(prompt, 0, [self.blocks_for(i, len(prompt))]) for i, prompt in enumerate(self.prompts)
        ]
        inputs = self.inputs(sequences, TorchMetadataBuilder(CPU))
        hidden_states = self.reference(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        self.num_tokens = list(PROMPT_LENS)
        return self.reference.compute_logits(hidden_states, inputs.logits_indices).argmax(-1).tolist()

    def blocks_for(self, request: int, num_tokens: int) -> list[int]:
        return self.blocks[request][: -(-num_tokens // BLOCK_SIZE)]

    def decode_sequences(self, tokens: list[int]) -> list[ScheduledSequence]:
        """The next decode step (one token per request); advances the token counts."""
        self.num_tokens = [n + 1 for n in self.num_tokens]
        return [
            ScheduledSequence([token], total - 1, [self.blocks_for(i, total)])
            for i, (token, total) in enumerate(zip(tokens, self.num_tokens, strict=True))
        ]

    @torch.no_grad()
    def eager_torch_step(self, sequences: list[ScheduledSequence]) -> tuple[torch.Tensor, list[int]]:
        """The reference: hidden states on the CPU backend, eagerly, and the greedy next tokens."""
        inputs = self.inputs(sequences, TorchMetadataBuilder(CPU))
        hidden_states = self.reference(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        logits = self.reference.compute_logits(hidden_states, inputs.logits_indices)
        return hidden_states, logits.argmax(-1).tolist()


def modules_of(model: torch.nn.Module, kind: type[torch.nn.Module]) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, kind)]


def tensor_shapes(inputs: ModelInputs) -> tuple[tuple[int, ...], ...]:
    """The shapes of every tensor a forward reads: ids, positions, and each metadata field and table."""
    metadata = inputs.forward_metadata
    fields = [getattr(metadata, name) for name in type(metadata).__slots__]
    tables = [tensor for group in metadata.groups for tensor in (group.block_table, group.slot_mapping)]
    tensors = [inputs.input_ids, inputs.positions, *tables, *(f for f in fields if isinstance(f, torch.Tensor))]
    return tuple(tuple(tensor.shape) for tensor in tensors)


def decode_and_compare(
    llama: PagedLlama, builder: AttentionMetadataBuilder, num_steps: int
) -> torch._dynamo.testing.CompileCounterWithBackend:
    """Prefill, then `num_steps` decode steps through the compiled model on its backend, each compared
    to the eager CPU path on the same step; returns the compile counter."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(llama.model, backend=counter, fullgraph=True, dynamic=False)
    tokens = llama.prefill()
    shapes = set()
    for _ in range(num_steps):
        sequences = llama.decode_sequences(tokens)
        inputs = llama.inputs(sequences, builder)
        shapes.add(tensor_shapes(inputs))
        with torch.no_grad():
            hidden_states = compiled(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        expected, tokens = llama.eager_torch_step(sequences)  # rewrites the same K/V into the same slots
        torch.testing.assert_close(hidden_states, expected, rtol=1e-4, atol=1e-5)
    assert len(shapes) == 1, f"decode inputs changed shape across steps: {shapes}"
    return counter


def test_torch_path_decode_traces_fullgraph_and_matches_eager():
    counter = decode_and_compare(PagedLlama(16, cpu_backend()), TorchMetadataBuilder(CPU), 1)
    assert counter.frame_count == 1


def test_torch_path_decode_steps_with_different_longest_kv_reuse_one_graph():
    llama = PagedLlama(16, cpu_backend())
    counter = decode_and_compare(llama, TorchMetadataBuilder(CPU), NUM_DECODE_STEPS)
    assert max(llama.num_tokens) - NUM_DECODE_STEPS == max(PROMPT_LENS)  # the longest KV grew every step
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {NUM_DECODE_STEPS} steps"


@pytest.mark.parametrize("head_dim", [16, 64], ids=["rotary_mul", "fused_rotary_in_place"])
def test_npu_graph_table_decode_traces_fullgraph_and_matches_the_torch_path(head_dim, monkeypatch):
    backend = npu_backend(monkeypatch, "ge_graph", traceable_torch_npu(), traceable_torchair())
    builder = NpuMetadataBuilder(CPU, lengths_as_tensors=True)
    counter = decode_and_compare(PagedLlama(head_dim, backend), builder, NUM_DECODE_STEPS)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {NUM_DECODE_STEPS} steps"


def test_npu_graph_table_graph_calls_the_torchair_attention_and_no_eager_one(monkeypatch):
    backend = npu_backend(monkeypatch, "ge_graph", traceable_torch_npu(), traceable_torchair())
    counter = decode_and_compare(PagedLlama(64, backend), NpuMetadataBuilder(CPU, lengths_as_tensors=True), 1)
    targets = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert any(target.startswith("fake_torchair_test.npu_fused_infer_attention_score") for target in targets)
    assert not any(target.startswith("fake_torch_npu_test.npu_fused_infer_attention_score") for target in targets)
    assert any(target.startswith("fake_torch_npu_test.npu_scatter_pa_kv_cache") for target in targets)


def test_npu_eager_table_decode_traces_fullgraph_and_matches_the_torch_path(monkeypatch):
    backend = npu_backend(monkeypatch, "eager", traceable_torch_npu())
    counter = decode_and_compare(PagedLlama(64, backend), NpuMetadataBuilder(CPU, lengths_as_tensors=False), 1)
    assert counter.frame_count == 1
