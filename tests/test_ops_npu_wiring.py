"""The NPU ops pass the documented torch_npu arguments (shared/npu-api-facts.md section 3), checked
against a recording stand-in for torch_npu, since this machine has no NPU."""

import pytest
import torch

from executor.core.engine.model_inputs import ScheduledSequence, build_model_inputs
from ops import npu

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 128, 4, 2, 64


class RecordingTorchNpu:
    """Records every call; returns tensors of the right shape."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[tuple, dict]] = {}

    def npu_fused_infer_attention_score(self, query, key, value, **kwargs):
        self.calls["fia"] = ((query, key, value), kwargs)
        return torch.zeros_like(query), torch.zeros(1)

    def npu_scatter_pa_kv_cache(self, *args, **kwargs):
        self.calls["scatter"] = (args, kwargs)

    def npu_rms_norm(self, x, gamma, epsilon):
        self.calls["rms_norm"] = ((x, gamma, epsilon), {})
        return x * 2, torch.ones(1)

    def npu_swiglu(self, x, dim=-1):
        self.calls["swiglu"] = ((x,), {"dim": dim})
        return x[..., : x.shape[-1] // 2]


@pytest.fixture
def fake_npu(monkeypatch) -> RecordingTorchNpu:
    recorder = RecordingTorchNpu()
    monkeypatch.setattr(npu, "torch_npu", lambda: recorder)
    return recorder


def caches() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.zeros(shape), torch.zeros(shape)


def metadata(is_prefill: bool):
    sequences = (
        [ScheduledSequence([1] * 3, 0, [5]), ScheduledSequence([1] * 5, 0, [2])]
        if is_prefill
        else [ScheduledSequence([1], 130, [5, 6]), ScheduledSequence([1], 4, [2])]
    )
    return build_model_inputs(sequences, is_prefill=is_prefill, block_size=BLOCK_SIZE, device=torch.device("cpu"))


def test_prefill_attention_is_tnd_paged_with_cumulative_q_and_per_request_kv(fake_npu):
    meta = metadata(is_prefill=True).forward_metadata
    key_cache, value_cache = caches()
    query = torch.zeros(8, NUM_HEADS, HEAD_DIM)
    npu.paged_attention(query, key_cache, value_cache, meta, scale=0.125)
    (q, k, v), kwargs = fake_npu.calls["fia"]
    assert q is query and k.shape == v.shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS * HEAD_DIM)
    assert kwargs["input_layout"] == "TND" and kwargs["block_size"] == BLOCK_SIZE
    assert kwargs["actual_seq_lengths"] == [3, 8] and kwargs["actual_seq_lengths_kv"] == [3, 5]
    assert kwargs["block_table"] is meta.block_table and kwargs["block_table"].dtype == torch.int32
    assert (kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["scale"]) == (NUM_HEADS, NUM_KV_HEADS, 0.125)
    assert kwargs["sparse_mode"] == 3
    mask = kwargs["atten_mask"]
    assert mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert mask[0, 1] == 1 and mask[1, 0] == 0 and mask[0, 0] == 0  # 1 = masked out, above the diagonal


def test_decode_attention_reads_per_request_kv_lengths_without_a_mask(fake_npu):
    meta = metadata(is_prefill=False).forward_metadata
    npu.paged_attention(torch.zeros(2, NUM_HEADS, HEAD_DIM), *caches(), meta, scale=0.125)
    _, kwargs = fake_npu.calls["fia"]
    assert kwargs["actual_seq_lengths"] == [1, 2] and kwargs["actual_seq_lengths_kv"] == [131, 5]
    assert kwargs["atten_mask"] is None


def test_kv_write_uses_the_nd_cache_mode_and_contiguous_inputs(fake_npu):
    key_cache, value_cache = caches()
    key = torch.zeros(NUM_KV_HEADS, 3, HEAD_DIM).transpose(0, 1)  # non-contiguous on purpose
    slots = torch.tensor([0, 1, 2])
    npu.write_kv_cache(key, key, key_cache, value_cache, slots)
    args, kwargs = fake_npu.calls["scatter"]
    assert kwargs == {"cache_mode": "Norm"}
    assert args[0].is_contiguous() and args[2] is key_cache and args[3] is value_cache and args[4] is slots


def test_rms_norm_takes_the_first_output_and_swiglu_splits_the_last_dim(fake_npu):
    x = torch.ones(2, 4)
    assert torch.equal(npu.rms_norm(x, torch.ones(4), 1e-5), x * 2)
    assert fake_npu.calls["rms_norm"][0][2] == 1e-5
    assert npu.silu_and_mul(torch.ones(2, 8)).shape == (2, 4)
    assert fake_npu.calls["swiglu"][1] == {"dim": -1}
