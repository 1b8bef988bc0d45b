"""Attention backends, one file per device (as vLLM v1's vllm/v1/attention/backends/): reference.py (torch
ops: the definition, and eager CUDA's), cpu.py (the C++ kernels), cuda_graph.py (a captured graph's
decode) and npu.py (torch_npu's FIA). Each is one object (AttentionBackend below) that the backend
record (ops/backend.py) holds as its `attention`; the layer (module/attention.py, module/mla.py)
hands it itself, and the backend reads the layer's scale, window, sinks, C8 scales and caches
(PagedKVLayer, LatentLayer), so no call passes them by position.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ops.attention.metadata import ForwardMetaData

# The forms an attention backend may have, by the names models require them (Backend.require): the
# paged K/V's write and attention (with sinks: gpt-oss), MLA's latent write and attention.
ATTENTION_KINDS = frozenset(
    {"write_kv_cache", "paged_attention", "paged_attention_with_sinks", "write_latent_cache", "mla_attention"}
)


class PagedKVLayer(Protocol):
    """What an attention backend reads off a paged K/V layer (module/attention.py's Attention)."""

    @property
    def scale(self) -> float: ...

    @property
    def sliding_window(self) -> int | None: ...  # None: no window

    @property
    def sinks(self) -> torch.Tensor | None: ...  # [H] a learned logit per query head (gpt-oss), or None

    @property
    def kv_cache_group_id(self) -> int: ...

    @property
    def key_cache(self) -> torch.Tensor: ...  # [num_blocks, block_size, Hkv, D]

    @property
    def value_cache(self) -> torch.Tensor: ...

    def kv_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key_scale, value_scale) of a C8 cache, else (None, None)."""
        ...


class LatentLayer(Protocol):
    """What an attention backend reads off an MLA layer (module/mla.py's MLAAttention)."""

    @property
    def scale(self) -> float: ...

    @property
    def kv_cache_group_id(self) -> int: ...

    @property
    def latent_cache(self) -> torch.Tensor: ...  # [num_blocks, block_size, L + R]

    @property
    def kv_b_weight(self) -> torch.Tensor: ...  # kv_b_proj's dense weight [H * (nope + v), L]

    def latent_scale(self) -> torch.Tensor | None: ...


class AttentionBackend(Protocol):
    """One device's attention: the cache writes and the attention of each cache kind it serves."""

    name: str
    kinds: frozenset[str]  # the ATTENTION_KINDS it has

    def write(self, layer: PagedKVLayer, key: torch.Tensor, value: torch.Tensor, metadata: ForwardMetaData) -> None: ...

    def forward(
        self,
        layer: PagedKVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: ForwardMetaData,
    ) -> torch.Tensor: ...

    def write_latent_cache(
        self,
        latent: torch.Tensor,
        latent_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        latent_scale: torch.Tensor | None = None,
    ) -> None: ...

    def mla(
        self, layer: LatentLayer, q_nope: torch.Tensor, q_pe: torch.Tensor, metadata: ForwardMetaData
    ) -> torch.Tensor: ...
