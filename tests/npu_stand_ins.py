"""Stand-ins for torch_npu and torchair, in one place: the NPU paths run on the CPU against them.

- RecordingTorchNpu / recording_torchair: record each call's arguments and return tensors of the
  right shape (tests/test_ops_npu_wiring.py checks what the NPU ops pass);
- CountingRuntime: npu_runtime's import helpers, counting how often they are called;
- traceable_torch_npu / traceable_torchair: each op a torch.library custom op computing the torch
  reference, so that dynamo traces the NPU path and its output can be compared (tests/test_dynamo_trace.py);
- compiling_torchair / npugraph_ex_npu: torchair's and torch.npu's compile entry points, recording
  their settings and compiling with dynamo's eager backend (tests/test_graph_compilers_wiring.py);
- npu_backend: the real make_backend's NPU record over any of these.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from executor.platform import npu_runtime
from ops.backend import Backend, make_backend

NO_LIMIT = 2147483647  # FIA's default pre_tokens / next_tokens

# ---------------------------------------------------------------------------------------------------
# Recording stand-ins.
Call = tuple[tuple[Any, ...], dict[str, Any]]


class RecordingTorchNpu:
    """Records every call by op name; returns tensors of the right shape."""

    def __init__(self) -> None:
        self.calls: dict[str, list[Call]] = {}

    def record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.setdefault(name, []).append((args, kwargs))

    def last(self, name: str) -> Call:
        return self.calls[name][-1]

    def npu_fused_infer_attention_score(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.record("fia", (query, key, value), kwargs)
        return torch.zeros_like(query), torch.zeros(1)

    def npu_scatter_pa_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        self.record("scatter", args, kwargs)

    def npu_rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.record("rms_norm", (x, gamma, epsilon), {})
        return x * 2, torch.ones(1)

    def npu_add_rms_norm(
        self, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.record("add_rms_norm", (x1, x2, gamma, epsilon), {})
        return (x1 + x2) * 2, torch.ones(1), x1 + x2

    def npu_apply_rotary_pos_emb(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.record("apply_rotary_pos_emb", (query, key, cos, sin), {})
        return query, key

    def npu_rotary_mul(self, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
        self.record("rotary_mul", (x, r1, r2), {})
        return x.clone()

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.record("swiglu", (x,), {"dim": dim})
        return x[..., : x.shape[-1] // 2]


class GroupedMatmulTorchNpu(RecordingTorchNpu):
    """RecordingTorchNpu whose npu_grouped_matmul (MoE form: group_type 0, counts as group_list_type 1,
    one output) and npu_swiglu compute what the op docs say: per group, x_g int8 @ W_g int8 in int32,
    times scale[g] per column and per_token_scale per row."""

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.record("swiglu", (x,), {"dim": dim})
        gate, up = x.chunk(2, dim=dim)
        return F.silu(gate) * up

    def npu_grouped_matmul(
        self, x: list[torch.Tensor], weight: list[torch.Tensor], **kwargs: Any
    ) -> list[torch.Tensor]:
        self.record("grouped_matmul", (x, weight), kwargs)
        assert kwargs["group_type"] == 0 and kwargs["group_list_type"] == 1 and kwargs["split_item"] == 2
        rows, outputs, start = x[0], [], 0
        for group, count in enumerate(kwargs["group_list"].tolist()):
            part = rows[start : start + count].to(torch.int64) @ weight[0][group].to(torch.int64)
            token_scale = kwargs["per_token_scale"][0][start : start + count, None]
            outputs.append(part.double() * token_scale.double() * kwargs["scale"][0][group].double())
            start += count
        return [torch.cat(outputs).to(kwargs["output_dtype"])]


def recording_torchair() -> SimpleNamespace:
    """torchair with the one op the graph modes call: `torchair.ops.npu_fused_infer_attention_score`."""
    return SimpleNamespace(ops=RecordingTorchNpu())


class CountingRuntime:
    """Stand-ins for npu_runtime.torch_npu / npu_runtime.torchair that count how often each is called."""

    def __init__(self) -> None:
        self.torch_npu_module = RecordingTorchNpu()
        self.torchair_module = recording_torchair()
        self.torch_npu_calls = 0
        self.torchair_calls = 0

    def torch_npu(self) -> RecordingTorchNpu:
        self.torch_npu_calls += 1
        return self.torch_npu_module

    def torchair(self) -> SimpleNamespace:
        self.torchair_calls += 1
        return self.torchair_module


def npu_backend(
    monkeypatch: pytest.MonkeyPatch, exe_mode: str, torch_npu: object, torchair: object | None = None
) -> Backend:
    """make_backend("npu", exe_mode) with npu_runtime handing out `torch_npu` and `torchair`."""
    monkeypatch.setattr(npu_runtime, "torch_npu", lambda: torch_npu)
    monkeypatch.setattr(npu_runtime, "torchair", lambda: torchair)
    return make_backend("npu", exe_mode)


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


def traceable_torch_npu() -> ModuleType:
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


def traceable_torchair() -> ModuleType:
    module = ModuleType("fake_torchair")
    module.ops = ModuleType("fake_torchair.ops")
    module.ops.npu_fused_infer_attention_score = torch.ops.fake_torchair_test.npu_fused_infer_attention_score
    return module


# ---------------------------------------------------------------------------------------------------
# Compiling stand-ins.


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def record(self, name: str, **kwargs: object) -> None:
        self.calls.append((name, kwargs))


def compiling_torchair(recorder: Recorder) -> SimpleNamespace:
    def compiler_config() -> SimpleNamespace:
        return SimpleNamespace(mode=None, experimental_config=SimpleNamespace())

    def get_npu_backend(*, compiler_config: SimpleNamespace) -> str:
        recorder.record("get_npu_backend", compiler_config=compiler_config)
        return "eager"

    def cache_compile(func, **kwargs):
        recorder.record("cache_compile", **kwargs)
        return torch.compile(func, backend="eager", dynamic=kwargs["dynamic"], fullgraph=True)

    return SimpleNamespace(
        CompilerConfig=compiler_config,
        get_npu_backend=get_npu_backend,
        inference=SimpleNamespace(cache_compile=cache_compile),
    )


def npugraph_ex_npu(recorder: Recorder, pool: object) -> SimpleNamespace:
    """torch.npu with its graph pool and npugraph_ex's cache_compile (recording its settings)."""

    def npugraph_ex_cache_compile(func, **kwargs):
        recorder.record("npugraph_ex.cache_compile", **kwargs)
        return torch.compile(func, backend="eager", fullgraph=True, dynamic=False)

    return SimpleNamespace(
        graph_pool_handle=lambda: pool,
        synchronize=lambda device=None: None,
        npugraph_ex=SimpleNamespace(inference=SimpleNamespace(cache_compile=npugraph_ex_cache_compile)),
    )


# ---------------------------------------------------------------------------------------------------
# Quantized-linear stand-ins: torch_npu's quantized matmuls with their documented semantics in plain
# torch (Ascend/op-plugin docs/context/torch_npu-npu_*.md; UNVERIFIED on hardware), recording calls.


def pack_int4_last_dim(values: torch.Tensor) -> torch.Tensor:
    """Eight int4 values of the last dim per int32 word, lowest nibble first (the stand-in's own
    order: the real op's interleaving is not documented, and only its pair op reads the words)."""
    nibbles = (values.to(torch.int64) & 0xF).unflatten(-1, (-1, 8))
    words = (nibbles << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4_last_dim(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    return torch.where(nibbles > 7, nibbles - 16, nibbles).flatten(-2).to(torch.int8)


class QuantRecordingTorchNpu(RecordingTorchNpu):
    """RecordingTorchNpu plus the quantized linears' ops, computing what their docs say."""

    def npu_dynamic_quant(self, x: torch.Tensor, *, smooth_scales=None, group_index=None, dst_type=None):
        """Per-token symmetric: scale = rowMax(|x|) / 127 (DTYPE_MAX), y = round(x / scale)."""
        self.record("dynamic_quant", (x,), {"smooth_scales": smooth_scales, "dst_type": dst_type})
        assert x.dtype in (torch.float16, torch.bfloat16) and x.dim() > 1
        scale = x.float().abs().amax(-1) / 127
        return torch.round(x.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale

    def npu_quant_matmul(
        self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, group_sizes=None
    ):
        """out = x1 @ x2 * scale * pertoken_scale + bias, x2 [K, N]."""
        kwargs = {"offset": offset, "pertoken_scale": pertoken_scale, "bias": bias, "output_dtype": output_dtype}
        self.record("quant_matmul", (x1, x2, scale), kwargs)
        assert x1.dtype == x2.dtype == torch.int8 and x1.shape[-1] == x2.shape[0]
        assert scale.dim() == 1 and scale.dtype in (torch.float32, torch.bfloat16)
        out = (x1.to(torch.int64) @ x2.to(torch.int64)).double() * scale.double()
        if pertoken_scale is not None:
            out = out * pertoken_scale.double().reshape(-1, 1)
        if bias is not None:
            out = out + bias.double()
        return out.to(output_dtype or torch.int8)

    def npu_convert_weight_to_int4pack(self, weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
        self.record("int4pack", (weight,), {"inner_k_tiles": inner_k_tiles})
        assert weight.dtype == torch.int32 and weight.is_contiguous() and weight.shape[-1] % 8 == 0
        assert int(weight.min()) >= -8 and int(weight.max()) <= 7
        return pack_int4_last_dim(weight)

    def npu_weight_quant_batchmatmul(
        self, x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
        antiquant_group_size=0, inner_precise=0,
    ):  # fmt: skip
        """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias, weight [K, N] (int32: int4 packed)."""
        args = (x, weight, antiquant_scale, antiquant_offset, quant_scale, quant_offset, bias, antiquant_group_size)
        self.record("weight_quant_batchmatmul", args, {})
        values = unpack_int4_last_dim(weight) if weight.dtype == torch.int32 else weight
        assert x.dtype in (torch.float16, torch.bfloat16) and antiquant_scale.dtype == x.dtype
        scale, offset = antiquant_scale.float(), None if antiquant_offset is None else antiquant_offset.float()
        if antiquant_group_size:
            assert antiquant_group_size % 32 == 0 and scale.shape == (
                x.shape[-1] // antiquant_group_size,
                values.shape[1],
            )
            scale = scale.repeat_interleave(antiquant_group_size, 0)
            offset = None if offset is None else offset.repeat_interleave(antiquant_group_size, 0)
        dense = (values.float() + (0 if offset is None else offset)) * scale
        out = x.float() @ dense
        if bias is not None:
            assert bias.dtype == (torch.float32 if x.dtype == torch.bfloat16 else torch.float16)
            out = out + bias.float()
        return out.to(x.dtype)
