"""The NPU's attention backend: torch_npu's paged cache write and its fused infer attention (FIA), as
laid out in shared/npu-api-facts.md §3; eager mode calls FIA with host lists, the graph modes
torchair's variant, which takes the lengths as tensors.

A C8 cache with static scales (per channel, [Hkv, D]) is written quantized in torch and read by FIA
with its antiquant scales per channel (key/value_antiquant_scale [Hkv * D], antiquant mode 0, the
BnBsH layout's channels); per-token-head scales (dynamic C8) are refused here: the FIA modes that take
them are not in shared/npu-api-facts.md. FIA takes sinks only in its v2 form (learnable_sink), and no
MLA form is called yet: a model needing them is refused on the NPU when it is built. Unverified on
hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ops import quant_math
from ops.attention import PagedKVLayer
from ops.attention.metadata import (
    AttentionMetadataBuilder,
    ForwardMetaData,
    StepLayout,
    cache_writes,
    group_block_table,
    to_device,
)

# FIA's compressed causal mask for sparse_mode=3 (bottom-right causal): always 2048x2048, 1 = masked.
NPU_CAUSAL_MASK_SIZE = 2048
_NO_LIMIT = 2147483647  # FIA's default pre_tokens / next_tokens
_PER_CHANNEL = 0  # FIA's key/value_antiquant_mode for one scale per channel


@dataclass(slots=True)
class NpuAttentionMetadata(ForwardMetaData):
    """npu_fused_infer_attention_score in TND with a paged cache: cumulative query ends and
    per-request KV lengths (host lists in eager mode, int64 device tensors for the torchair graph
    variant), and the mask and sparse mode the step's longest query calls for."""

    actual_seq_lengths_q: list[int] | torch.Tensor | None = None
    actual_seq_lengths_kv: list[int] | torch.Tensor | None = None
    atten_mask: torch.Tensor | None = None
    sparse_mode: int = 0


class NpuMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, device: torch.device, lengths_as_tensors: bool) -> None:
        super().__init__(device)
        self.lengths_as_tensors = lengths_as_tensors
        self._causal_mask: torch.Tensor | None = None

    def build(self, layout: StepLayout) -> NpuAttentionMetadata:
        metadata = NpuAttentionMetadata(layout.max_query_len, self.cache_group_tables(layout))
        if self.lengths_as_tensors:
            metadata.actual_seq_lengths_q = to_device(layout.query_ends, torch.int64, self.device)
            metadata.actual_seq_lengths_kv = to_device(layout.seq_lens, torch.int64, self.device)
        else:
            metadata.actual_seq_lengths_q = list(layout.query_ends)
            metadata.actual_seq_lengths_kv = list(layout.seq_lens)
        if not metadata.is_decode_shaped:  # a verify step (k+1 queries) is as causal as a prefill
            metadata.atten_mask = self.causal_mask()
            metadata.sparse_mode = 3  # bottom-right causal: queries aligned to the end of their KV
        return metadata

    def causal_mask(self) -> torch.Tensor:
        if self._causal_mask is None:
            size = NPU_CAUSAL_MASK_SIZE
            mask = torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1)
            self._causal_mask = mask.to(torch.int8).to(self.device)
        return self._causal_mask


def _static_scales(
    key_scale: torch.Tensor | None, value_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's static per-channel scales; dynamic ones are refused (see the module docstring)."""
    if key_scale is None or value_scale is None or key_scale.dim() != 2:
        raise NotImplementedError(
            "the NPU runs a C8 KV cache with static scales only (a kv_cache_scheme checkpoint); "
            "dynamic per-token-head scales (model_config.quantization c8) run on cpu or cuda"
        )
    return key_scale, value_scale


class NpuAttention:
    """Eager mode: FIA with host int lists."""

    name = "npu"
    kinds = frozenset({"write_kv_cache", "paged_attention"})

    def __init__(self, torch_npu: ModuleType) -> None:
        self.torch_npu = torch_npu

    def write_kv_cache(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """torch_npu's scatter into the layer's caches (quantized first into a C8 cache)."""
        key_cache, value_cache = layer.key_cache, layer.value_cache
        if key_cache.dtype == torch.int8:
            key_scale, value_scale = _static_scales(*layer.kv_scales())
            key, value = (
                quant_math.quantize_kv_static(key, key_scale),
                quant_math.quantize_kv_static(value, value_scale),
            )
        self.torch_npu.npu_scatter_pa_kv_cache(
            key.contiguous(), value.contiguous(), key_cache, value_cache, slots, cache_mode="Norm"
        )

    def write(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, metadata: ForwardMetaData) -> None:
        (key_rows, value_rows), slots = cache_writes(metadata, layer.kv_cache_group_id, key, value)
        self.write_kv_cache(layer, key_rows, value_rows, slots)

    def write_latent_cache(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the npu attention backend has no latent cache write")

    def mla(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the npu attention backend has no MLA form")

    def forward(
        self,
        layer: PagedKVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: ForwardMetaData,
    ) -> torch.Tensor:
        """One fused call for every step shape (prefill, chunk, decode, verify), as vllm-ascend does.

        TND with paged KV takes cumulative query ends but per-request KV lengths, and the cache as
        [num_blocks, block_size, Hkv * D]; FIA reads the step's own K/V from there, where
        write_kv_cache has put them, so `key` and `value` go unused. The metadata's mask and sparse
        mode follow the step's longest query. A sliding window uses the band mode (sparse_mode 4, pre_tokens = window,
        next_tokens 0) on steps with a mask and only pre_tokens = window in decode, as vllm-ascend
        does; unverified on hardware. An int8 cache adds its antiquant scales (the module docstring).
        """
        assert isinstance(metadata, NpuAttentionMetadata)
        key_cache, value_cache = layer.key_cache, layer.value_cache
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        antiquant: dict[str, Any] = {}
        if key_cache.dtype == torch.int8:
            key_scale, value_scale = _static_scales(*layer.kv_scales())
            antiquant = {
                "key_antiquant_scale": key_scale.reshape(-1).to(query.dtype),
                "value_antiquant_scale": value_scale.reshape(-1).to(query.dtype),
                "key_antiquant_mode": _PER_CHANNEL,
                "value_antiquant_mode": _PER_CHANNEL,
            }
        sparse_mode, pre_tokens, next_tokens = metadata.sparse_mode, _NO_LIMIT, _NO_LIMIT
        if layer.sliding_window is not None:
            pre_tokens = layer.sliding_window
            if metadata.atten_mask is not None:  # band mode; decode keeps next_tokens open
                sparse_mode, next_tokens = 4, 0
        output, _ = self.fused_infer_attention_score(
            query,
            key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            atten_mask=metadata.atten_mask,
            block_table=group_block_table(metadata, layer.kv_cache_group_id),
            actual_seq_lengths=metadata.actual_seq_lengths_q,
            actual_seq_lengths_kv=metadata.actual_seq_lengths_kv,
            num_heads=query.shape[1],
            num_key_value_heads=num_kv_heads,
            scale=layer.scale,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            input_layout="TND",
            sparse_mode=sparse_mode,
            block_size=block_size,
            **antiquant,
        )
        return output

    def fused_infer_attention_score(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.torch_npu.npu_fused_infer_attention_score(*args, **kwargs)


class NpuGraphAttention(NpuAttention):
    """ge_graph / npugraph_ex: FIA through torchair's variant, whose sequence lengths are int64 device
    tensors, so the graph holds no host list that changes every step."""

    name = "npu_graph"

    def __init__(self, torch_npu: ModuleType, torchair: ModuleType) -> None:
        super().__init__(torch_npu)
        self.torchair = torchair

    def fused_infer_attention_score(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.torchair.ops.npu_fused_infer_attention_score(*args, **kwargs)
