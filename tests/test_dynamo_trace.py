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
from types import ModuleType

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
import transformers

import ops
from executor.types_.model_inputs import ModelInputs, ScheduledSequence, build_step_layout
from models.llama import LlamaForCausalLM
from module.attention import Attention
from ops import dispatch
from ops.attention_metadata import (
    AttentionMetadataBuilder,
    NpuMetadataBuilder,
    TorchMetadataBuilder,
    build_model_inputs,
)
from ops.npu import NpuGraphOps, NpuOps
from tests.conftest import llama_config

CPU = torch.device("cpu")
VOCAB, BLOCK_SIZE, NUM_BLOCKS, MAX_POSITIONS = 128, 4, 64, 64
PROMPT_LENS = [3, 11, 6]  # the longest KV crosses a block boundary during the decode steps
NUM_DECODE_STEPS = 3
NO_LIMIT = 2147483647

# ---------------------------------------------------------------------------------------------------
# A fake torch_npu / torchair: each op a custom op in a test-only namespace, computing the torch
# reference with the documented signature (shared/npu-api-facts.md section 3). Tensor arguments that
# the real ops take as keywords stay positional-or-keyword here (custom_op has no keyword-only tensors).


def _returns_nothing(*args: object, **kwargs: object) -> None:
    """The fake of an op that only writes into its arguments."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return gamma * (x.float() * rstd).to(x.dtype), rstd


@torch.library.custom_op("fake_torch_npu_test::npu_rms_norm", mutates_args=())
def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm(x, gamma, epsilon)


@npu_rms_norm.register_fake
def _(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@torch.library.custom_op("fake_torch_npu_test::npu_add_rms_norm", mutates_args=())
def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x_out = x1 + x2
    y, rstd = _rms_norm(x_out, gamma, epsilon)
    return y, rstd, x_out


@npu_add_rms_norm.register_fake
def _(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x1), x1.new_empty(*x1.shape[:-1], 1, dtype=torch.float32), torch.empty_like(x1)


@torch.library.custom_op("fake_torch_npu_test::npu_apply_rotary_pos_emb_", mutates_args=("query", "key"))
def npu_apply_rotary_pos_emb_(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> None:
    assert layout == "BSND" and rotary_mode == "half" and query.shape[-1] in (64, 128)
    assert query.dim() == 4 and cos.shape == (query.shape[0], query.shape[1], 1, query.shape[3])
    query.copy_(query * cos + _rotate_half(query) * sin)
    key.copy_(key * cos + _rotate_half(key) * sin)


npu_apply_rotary_pos_emb_.register_fake(_returns_nothing)


def fake_npu_apply_rotary_pos_emb(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "BSND"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like the real op: rotates query and key in place and returns them."""
    torch.ops.fake_torch_npu_test.npu_apply_rotary_pos_emb_(query, key, cos, sin, layout)
    return query, key


@torch.library.custom_op("fake_torch_npu_test::npu_rotary_mul", mutates_args=())
def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    assert rotary_mode == "half"
    return x * r1 + _rotate_half(x) * r2


@npu_rotary_mul.register_fake
def _(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fake_torch_npu_test::npu_swiglu", mutates_args=())
def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    gate, up = x.chunk(2, dim=dim)
    return F.silu(gate) * up


@npu_swiglu.register_fake
def _(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    gate, _ = x.chunk(2, dim=dim)
    return torch.empty_like(gate)


@torch.library.custom_op("fake_torch_npu_test::npu_scatter_pa_kv_cache", mutates_args=("key_cache", "value_cache"))
def npu_scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_mode: str = "PA_NZ",
) -> None:
    assert cache_mode == "Norm", "this stand-in writes ND caches only"
    assert key.is_contiguous() and value.is_contiguous()
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


npu_scatter_pa_kv_cache.register_fake(_returns_nothing)


def fia_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    atten_mask: torch.Tensor | None,
    block_table: torch.Tensor | None,
    query_ends: list[int],
    kv_lens: list[int],
    num_heads: int,
    scale: float,
    pre_tokens: int,
    next_tokens: int,
    input_layout: str,
    num_key_value_heads: int,
    sparse_mode: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA in TND over a paged [num_blocks, block_size, Hkv * D] cache: cumulative query ends,
    per-request KV lengths; sparse_mode 0 (no mask), 3 (bottom-right causal), 4 (band)."""
    assert input_layout == "TND" and block_table is not None and block_table.dtype == torch.int32
    assert query.shape[1] == num_heads and key.shape[1] == block_size
    assert (sparse_mode == 0) == (atten_mask is None) and sparse_mode in (0, 3, 4)
    head_dim = query.shape[-1]
    key = key.view(key.shape[0], block_size, num_key_value_heads, head_dim)
    value = value.view(value.shape[0], block_size, num_key_value_heads, head_dim)
    outputs, query_start = [], 0
    for index, (query_end, kv_len) in enumerate(zip(query_ends, kv_lens, strict=True)):
        q_len = query_end - query_start
        blocks = block_table[index, : -(-kv_len // block_size)].long()
        request_key = key[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)  # [Hkv, kv_len, D]
        request_value = value[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)
        query_positions = torch.arange(kv_len - q_len, kv_len)[:, None]  # aligned to the end of the KV
        key_positions = torch.arange(kv_len)[None, :]
        allowed = (query_positions - key_positions < pre_tokens) & (key_positions - query_positions <= next_tokens)
        if sparse_mode == 3:
            allowed &= key_positions <= query_positions
        out = F.scaled_dot_product_attention(
            query[query_start:query_end].transpose(0, 1),
            request_key,
            request_value,
            attn_mask=allowed,
            scale=scale,
            enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1))
        query_start = query_end
    return torch.cat(outputs), query.new_zeros(1)


# FIA's argument list, as one schema for both variants: torch_npu's takes the sequence lengths as
# host int lists, torchair's as int64 tensors.
_FIA_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor? atten_mask=None, Tensor? block_table=None, "
    "{lengths} actual_seq_lengths=None, {lengths} actual_seq_lengths_kv=None, int num_heads=1, float scale=1.0, "
    f'int pre_tokens={NO_LIMIT}, int next_tokens={NO_LIMIT}, str input_layout="BSH", int num_key_value_heads=0, '
    "int sparse_mode=0, int block_size=0) -> (Tensor, Tensor)"
)


def _fia(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, atten_mask, block_table, actual_seq_lengths,
         actual_seq_lengths_kv, *args):  # fmt: skip
    assert actual_seq_lengths is not None and actual_seq_lengths_kv is not None
    if isinstance(actual_seq_lengths, torch.Tensor):
        assert actual_seq_lengths.dtype == actual_seq_lengths_kv.dtype == torch.int64
        actual_seq_lengths, actual_seq_lengths_kv = actual_seq_lengths.tolist(), actual_seq_lengths_kv.tolist()
    return fia_reference(
        query, key, value, atten_mask, block_table, list(actual_seq_lengths), list(actual_seq_lengths_kv), *args
    )


def _fia_shapes(query: torch.Tensor, *args):
    return torch.empty_like(query), query.new_empty(1)


for _namespace, _lengths in (("fake_torch_npu_test", "int[]?"), ("fake_torchair_test", "Tensor?")):
    torch.library.custom_op(
        f"{_namespace}::npu_fused_infer_attention_score",
        _fia,
        mutates_args=(),
        schema=_FIA_SCHEMA.format(lengths=_lengths),
    ).register_fake(_fia_shapes)


def fake_torch_npu() -> ModuleType:
    module = ModuleType("fake_torch_npu")
    fake_ops = torch.ops.fake_torch_npu_test
    module.npu_rms_norm = fake_ops.npu_rms_norm
    module.npu_add_rms_norm = fake_ops.npu_add_rms_norm
    module.npu_apply_rotary_pos_emb = fake_npu_apply_rotary_pos_emb
    module.npu_rotary_mul = fake_ops.npu_rotary_mul
    module.npu_swiglu = fake_ops.npu_swiglu
    module.npu_scatter_pa_kv_cache = fake_ops.npu_scatter_pa_kv_cache
    module.npu_fused_infer_attention_score = fake_ops.npu_fused_infer_attention_score
    return module


def fake_torchair() -> ModuleType:
    module = ModuleType("fake_torchair")
    module.ops = ModuleType("fake_torchair.ops")
    module.ops.npu_fused_infer_attention_score = torch.ops.fake_torchair_test.npu_fused_infer_attention_score
    return module


# ---------------------------------------------------------------------------------------------------
# The model, driven as the engine drives it.


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(autouse=True)
def torch_backend() -> Iterator[None]:
    """Every test starts on the torch table with a clean dynamo cache, and leaves the torch table."""
    ops.set_backend("torch")
    torch._dynamo.reset()
    yield
    ops.set_backend("torch")
    torch._dynamo.reset()


class PagedLlama:
    """Our Llama with HF's random weights, NaN-filled caches and scattered blocks, driven step by step."""

    def __init__(self, head_dim: int) -> None:
        config = llama_config(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=head_dim,
            vocab_size=VOCAB,
            max_position_embeddings=MAX_POSITIONS,
        )
        torch.manual_seed(0)
        hf_model = transformers.LlamaForCausalLM(config).eval()
        self.model = LlamaForCausalLM(config).eval()
        self.model.load_weights(hf_model.state_dict().items())
        for attention in (m for m in self.model.modules() if isinstance(m, Attention)):
            shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, head_dim)
            caches = {"key": torch.full(shape, float("nan")), "value": torch.full(shape, float("nan"))}
            attention.bind_kv_cache(caches, group_id=0)
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
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        self.num_tokens = list(PROMPT_LENS)
        return self.model.compute_logits(hidden_states, inputs.logits_indices).argmax(-1).tolist()

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
        """The reference: hidden states on the torch table, eagerly, and the greedy next tokens."""
        with_table(dispatch.make_op_table("torch"))
        inputs = self.inputs(sequences, TorchMetadataBuilder(CPU))
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        return hidden_states, self.model.compute_logits(hidden_states, inputs.logits_indices).argmax(-1).tolist()


def with_table(table: dispatch.OpTable) -> None:
    dispatch._current = table  # the fixtures put the torch table back


def tensor_shapes(inputs: ModelInputs) -> tuple[tuple[int, ...], ...]:
    """The shapes of every tensor a forward reads: ids, positions, and each metadata field and table."""
    metadata = inputs.forward_metadata
    fields = [getattr(metadata, name) for name in type(metadata).__slots__]
    tables = [tensor for group in metadata.groups for tensor in (group.block_table, group.slot_mapping)]
    tensors = [inputs.input_ids, inputs.positions, *tables, *(f for f in fields if isinstance(f, torch.Tensor))]
    return tuple(tuple(tensor.shape) for tensor in tensors)


def decode_and_compare(
    llama: PagedLlama, table: dispatch.OpTable, builder: AttentionMetadataBuilder, num_steps: int
) -> torch._dynamo.testing.CompileCounterWithBackend:
    """Prefill, then `num_steps` decode steps through the compiled model on `table`, each compared to the
    eager torch path on the same step; returns the compile counter."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(llama.model, backend=counter, fullgraph=True, dynamic=False)
    tokens = llama.prefill()
    shapes = set()
    for _ in range(num_steps):
        sequences = llama.decode_sequences(tokens)
        inputs = llama.inputs(sequences, builder)
        shapes.add(tensor_shapes(inputs))
        with_table(table)
        with torch.no_grad():
            hidden_states = compiled(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        expected, tokens = llama.eager_torch_step(sequences)  # rewrites the same K/V into the same slots
        torch.testing.assert_close(hidden_states, expected, rtol=1e-4, atol=1e-5)
    assert len(shapes) == 1, f"decode inputs changed shape across steps: {shapes}"
    return counter


def test_torch_path_decode_traces_fullgraph_and_matches_eager():
    counter = decode_and_compare(PagedLlama(head_dim=16), dispatch.make_op_table("torch"), TorchMetadataBuilder(CPU), 1)
    assert counter.frame_count == 1


def test_torch_path_decode_steps_with_different_longest_kv_reuse_one_graph():
    llama = PagedLlama(head_dim=16)
    counter = decode_and_compare(llama, dispatch.make_op_table("torch"), TorchMetadataBuilder(CPU), NUM_DECODE_STEPS)
    assert max(llama.num_tokens) - NUM_DECODE_STEPS == max(PROMPT_LENS)  # the longest KV grew every step
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {NUM_DECODE_STEPS} steps"


@pytest.mark.parametrize("head_dim", [16, 64], ids=["rotary_mul", "fused_rotary_in_place"])
def test_npu_graph_table_decode_traces_fullgraph_and_matches_the_torch_path(head_dim):
    table = dispatch.OpTable("npu", "ge_graph", NpuGraphOps(fake_torch_npu(), fake_torchair()))
    builder = NpuMetadataBuilder(CPU, lengths_as_tensors=True)
    counter = decode_and_compare(PagedLlama(head_dim), table, builder, NUM_DECODE_STEPS)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {NUM_DECODE_STEPS} steps"


def test_npu_graph_table_graph_calls_the_torchair_attention_and_no_eager_one():
    table = dispatch.OpTable("npu", "ge_graph", NpuGraphOps(fake_torch_npu(), fake_torchair()))
    counter = decode_and_compare(PagedLlama(64), table, NpuMetadataBuilder(CPU, lengths_as_tensors=True), 1)
    targets = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert any(target.startswith("fake_torchair_test.npu_fused_infer_attention_score") for target in targets)
    assert not any(target.startswith("fake_torch_npu_test.npu_fused_infer_attention_score") for target in targets)
    assert any(target.startswith("fake_torch_npu_test.npu_scatter_pa_kv_cache") for target in targets)


def test_npu_eager_table_decode_traces_fullgraph_and_matches_the_torch_path():
    table = dispatch.OpTable("npu", "eager", NpuOps(fake_torch_npu()))
    counter = decode_and_compare(PagedLlama(64), table, NpuMetadataBuilder(CPU, lengths_as_tensors=False), 1)
    assert counter.frame_count == 1
