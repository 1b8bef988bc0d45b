"""C8, the int8 KV cache, op by op: every attention path over an int8 cache (the torch reference and
the CPU kernels; decode and non-decode steps, GQA, a sliding window, sinks, MLA's latent) equals the
same attention over the fake-quantized cache, the int8 values dequantized into a float cache, within
1e-5 (fp32: the two differ by summation order only). The drift from the unquantized cache is printed
and held to a loose bound (int8 rounding: about max|x| / 255 per value).

Every key is read back from the cache, the step's own too, so the reference is given the step's K/V
fake-quantized. Unwritten slots hold NaN scales (dynamic) and must never be read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ops import cpu_kernels, quant_math
from ops.attention import reference
from ops.attention.cpu import CpuAttention
from ops.attention.metadata import ScheduledSequence, TorchMetadataBuilder, build_model_inputs, build_step_layout
from ops.attention.reference import ReferenceAttention
from tests.attention_layers import attend, write_kv

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 4, 4, 2, 64
MAX_BLOCKS = 6
SCALE = HEAD_DIM**-0.5
C8_ATOL = 1e-5
DRIFT_ATOL = 0.15  # int8 rounding of N(0, 1) keys and values (static scales: steps up to 0.045) through a softmax
CPU = torch.device("cpu")

# (cached tokens, fed tokens, blocks) per request: a prefill, a chunk after a cached prefix, and decode.
PREFILL = [(0, 7, [3, 8]), (5, 6, [1, 10, 4])]
DECODE = [(9, 1, [3, 8, 5]), (6, 1, [1, 10])]


def kernels_or_skip() -> object:
    kernels = cpu_kernels.extension()
    if kernels is None:
        pytest.fail("the CPU kernels did not build on this machine")
    return kernels


def implementations() -> dict[str, object]:
    return {"reference": ReferenceAttention(), "cpu": CpuAttention(kernels_or_skip())}


def step_metadata(requests: list[tuple[int, int, list[int]]]):
    sequences = [ScheduledSequence([1] * fed, cached, [blocks]) for cached, fed, blocks in requests]
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS)
    return build_model_inputs(layout, TorchMetadataBuilder(CPU)).forward_metadata


def slots_of(cached: int, count: int, blocks: list[int]) -> list[int]:
    return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + count)]


def static_scales(dtype: torch.dtype) -> torch.Tensor:
    """Per-channel scales [Hkv, D] that cover N(0, 1) values: about 4 / 127.5, varied per channel."""
    return (torch.rand(NUM_KV_HEADS, HEAD_DIM) * 0.02 + 0.025).float()


class Caches:
    """An int8 cache with its scales, written through `ops`, and the float cache it stands for."""

    def __init__(self, dynamic: bool, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key = torch.zeros(shape, dtype=torch.int8)
        self.value = torch.zeros(shape, dtype=torch.int8)
        if dynamic:
            self.key_scale = torch.full(shape[:-1], float("nan"))
            self.value_scale = torch.full(shape[:-1], float("nan"))
        else:
            self.key_scale, self.value_scale = static_scales(dtype), static_scales(dtype)
        self.plain_key = torch.full(shape, float("nan"), dtype=dtype)  # the unquantized K/V, for the drift
        self.plain_value = torch.full(shape, float("nan"), dtype=dtype)
        self.dtype = dtype

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        return {"key_scale": self.key_scale, "value_scale": self.value_scale}

    def write(self, ops: object, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        write_kv(ops, key, value, self.key, self.value, slots, self.key_scale, self.value_scale)
        reference.write_kv_cache(key, value, self.plain_key, self.plain_value, slots)

    def dequantized(self, cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if scale.dim() == 3:
            return quant_math.dequantize_kv(cache, self.dtype, token_scale=scale)
        return quant_math.dequantize_kv(cache, self.dtype, channel_scale=scale)

    def fake_quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequantized(self.key, self.key_scale), self.dequantized(self.value, self.value_scale)


def run_step(ops: object, requests, dynamic: bool, dtype: torch.dtype, sliding_window: int | None, sinks):
    """Write each request's prefix, then the step's K/V, and attend: -> (C8 output, fake-quantized
    reference, unquantized output)."""
    torch.manual_seed(0)
    caches = Caches(dynamic, (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype)
    for cached, _, blocks in requests:
        if cached:
            kv = torch.randn(2, cached, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
            caches.write(ops, kv[0], kv[1], torch.tensor(slots_of(0, cached, blocks)))
    metadata = step_metadata(requests)
    tokens = sum(fed for _, fed, _ in requests)
    query = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)
    key, value = torch.randn(2, tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    slots = metadata.groups[0].slot_mapping
    caches.write(ops, key, value, slots)
    table = metadata.groups[0].block_table

    def attend_over(attention, step_key, step_value, key_cache, value_cache, **scales):
        caches = (key_cache, value_cache, table, metadata)
        return attend(attention, query, step_key, step_value, *caches, SCALE, sliding_window, sinks, **scales)

    c8 = attend_over(ops, key, value, caches.key, caches.value, **caches.scales)
    fake_key, fake_value = caches.fake_quantized()
    step_key, step_value = (
        fake_key.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots],
        fake_value.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots],
    )
    fake_quantized = attend_over(ReferenceAttention(), step_key, step_value, fake_key, fake_value)
    plain = attend_over(ReferenceAttention(), key, value, caches.plain_key, caches.plain_value)
    return c8, fake_quantized, plain


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("window_sinks", [(None, False), (3, False), (None, True)], ids=["full", "window", "sinks"])
def test_c8_attention_equals_attention_over_the_fake_quantized_cache(impl, dynamic, step, window_sinks):
    sliding_window, with_sinks = window_sinks
    sinks = torch.randn(NUM_HEADS) if with_sinks else None
    requests = PREFILL if step == "prefill" else DECODE
    c8, reference, plain = run_step(implementations()[impl], requests, dynamic, torch.float32, sliding_window, sinks)
    assert not c8.isnan().any()
    torch.testing.assert_close(c8, reference, atol=C8_ATOL, rtol=0)
    drift = (c8 - plain).abs().max().item()
    print(f"C8 {impl} {step} {'dynamic' if dynamic else 'static'}: max drift from the unquantized cache {drift:.2e}")
    assert drift < DRIFT_ATOL


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_c8_attention_in_bf16_reads_int8_with_fp32_scales(step):
    requests = PREFILL if step == "prefill" else DECODE
    c8, reference, _ = run_step(implementations()["cpu"], requests, True, torch.bfloat16, None, None)
    torch.testing.assert_close(c8.float(), reference.float(), atol=2e-2, rtol=0)  # bf16 rounding of the output


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_cpu_write_kernel_quantizes_as_the_reference(dynamic):
    """The C++ write gives the reference's int8 values and scales, value for value."""
    kernels = CpuAttention(kernels_or_skip())
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    torch.manual_seed(1)
    key, value = torch.randn(2, 20, NUM_KV_HEADS, HEAD_DIM) * 3
    key[3, 1] = 0.0  # a zero row: its scale is fp32's eps, as compressed-tensors makes it
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:20]
    ours, theirs = Caches(dynamic, shape, torch.float32), Caches(dynamic, shape, torch.float32)
    theirs.key_scale, theirs.value_scale = ours.key_scale.clone(), ours.value_scale.clone()
    ours.write(kernels, key, value, slots)
    theirs.write(ReferenceAttention(), key, value, slots)
    assert torch.equal(ours.key, theirs.key) and torch.equal(ours.value, theirs.value)
    torch.testing.assert_close(ours.key_scale, theirs.key_scale, atol=0, rtol=0, equal_nan=True)


def latent_step(ops: object, requests, dynamic: bool):
    """MLA over an int8 latent cache: -> (C8 output, reference over the dequantized latents)."""
    torch.manual_seed(2)
    num_heads, nope, rope, rank, v_dim = 4, 16, 8, 32, 16
    width = rank + rope
    latent_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, width, dtype=torch.int8)
    scale = torch.full((NUM_BLOCKS, BLOCK_SIZE, 1), float("nan")) if dynamic else torch.rand(1, width) * 0.02 + 0.025
    kv_b = torch.randn(num_heads * (nope + v_dim), rank) * 0.1
    for cached, _, blocks in requests:
        if cached:
            ops.attention.write_latent_cache(
                torch.randn(cached, width), latent_cache, torch.tensor(slots_of(0, cached, blocks)), scale
            )
    metadata = step_metadata(requests)
    tokens = sum(fed for _, fed, _ in requests)
    ops.attention.write_latent_cache(torch.randn(tokens, width), latent_cache, metadata.groups[0].slot_mapping, scale)
    q_nope, q_pe = torch.randn(tokens, num_heads, nope), torch.randn(tokens, num_heads, rope)
    table = metadata.groups[0].block_table
    layer = SimpleNamespace(
        scale=0.2, kv_cache_group_id=0, latent_cache=latent_cache, kv_b_weight=kv_b, latent_scale=lambda: scale
    )
    c8 = ops.attention.mla(layer, q_nope, q_pe, metadata)
    if dynamic:
        dense = quant_math.dequantize_kv(latent_cache.unsqueeze(2), torch.float32, token_scale=scale)[:, :, 0]
    else:
        dense = quant_math.dequantize_kv(latent_cache.unsqueeze(2), torch.float32, channel_scale=scale)[:, :, 0]
    return c8, reference.mla_attention(q_nope, q_pe, dense, kv_b, table, metadata, 0.2)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_mla_over_an_int8_latent_cache_equals_mla_over_the_dequantized_latents(backend, dynamic, step):
    from tests.backends import cpu_backend, reference_backend

    record = cpu_backend() if backend == "cpu" else reference_backend()
    requests = PREFILL if step == "prefill" else DECODE
    c8, reference = latent_step(record, requests, dynamic)
    assert not c8.isnan().any()
    torch.testing.assert_close(c8, reference, atol=C8_ATOL, rtol=0)


def test_npu_writes_static_c8_as_int8_and_gives_fia_its_per_channel_antiquant_scales():
    """Against the recording stand-in (tests/npu_stand_ins.py), as tests/test_ops_npu_wiring.py does."""
    from ops.attention.npu import NpuAttention
    from tests.npu_stand_ins import RecordingTorchNpu
    from tests.test_ops_npu_wiring import DECODE as NPU_DECODE
    from tests.test_ops_npu_wiring import model_inputs

    torch_npu = RecordingTorchNpu()
    ops = NpuAttention(torch_npu)
    shape = (8, 128, 2, 64)
    key_cache, value_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    key_scale, value_scale = static_scales(torch.float32), static_scales(torch.float32)
    key, value = torch.randn(2, 2, 2, 64)
    write_kv(ops, key, value, key_cache, value_cache, torch.tensor([3, 9]), key_scale, value_scale)
    (written_key, written_value, *_), _ = torch_npu.last("scatter")
    assert written_key.dtype == torch.int8
    assert torch.equal(written_key, quant_math.quantize_kv_static(key, key_scale))
    meta = model_inputs(NPU_DECODE).forward_metadata
    query = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    caches = (key_cache, value_cache, meta.groups[0].block_table, meta)
    attend(ops, query, key, value, *caches, 0.125, None, None, key_scale, value_scale)
    (_, cache_key, _), kwargs = torch_npu.last("fia")
    assert cache_key.dtype == torch.int8 and cache_key.shape == (8, 128, 128)  # BnBsH
    assert kwargs["key_antiquant_mode"] == kwargs["value_antiquant_mode"] == 0
    assert torch.equal(kwargs["key_antiquant_scale"], key_scale.reshape(-1).to(torch.bfloat16))
    assert kwargs["value_antiquant_scale"].shape == (128,)


def test_npu_refuses_dynamic_c8_in_one_line():
    from ops.attention.npu import NpuAttention
    from tests.npu_stand_ins import RecordingTorchNpu

    cache = torch.zeros(8, 128, 2, 64, dtype=torch.int8)
    scales = torch.zeros(8, 128, 2)
    with pytest.raises(NotImplementedError, match="static scales only"):
        write_kv(
            NpuAttention(RecordingTorchNpu()),
            torch.randn(1, 2, 64),
            torch.randn(1, 2, 64),
            cache,
            cache.clone(),
            torch.tensor([0]),
            scales,
            scales,
        )
