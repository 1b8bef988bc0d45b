"""The CPU backend's ops: each C++ kernel of ops/cpu_kernels.py behind its shape guard, falling back
to the reference (ops/torch_ref.py) where the guard fails.

The backend takes these only where the extension built (and the fused elementwise ones only for
fp32 models), decided once in ops/backend.py; so the guards here are about shapes, and about
torch.compile, which cannot trace a pybind call and fuses the reference's ops itself. The decode
attention is its own custom op, so that a compiled decode still sees one opaque call; the CPU's MLA
is the reference's over it (ops/backend.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ops import torch_ref
from ops.attention_metadata import TorchAttentionMetadata
from ops.cpu_kernels import extension, named


@torch.library.custom_op("infer_recipes::cpu_paged_decode_attention", mutates_args=())
def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch_ref.paged_decode_attention by the C++ kernel, which reads each request's slots in place
    instead of gathering a padded copy. Registered only once the extension built (CpuOps)."""
    kernel = extension().paged_decode_attention
    return kernel(query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window, sinks)


@paged_decode_attention.register_fake
def _(query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window, sinks=None):
    return torch.empty_like(query)


class CpuOps:
    """The C++ kernels of one built extension, as ops with the reference's signatures."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_contiguous() and not torch.compiler.is_compiling():
            return named("fused_rms_norm", self.kernels.fused_rms_norm)(x, weight.contiguous(), eps)
        return torch_ref.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        contiguous = x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
        if contiguous and not torch.compiler.is_compiling():
            normed, new_residual = named("fused_add_rms_norm", self.kernels.fused_add_rms_norm)(
                x, residual, weight.contiguous(), eps
            )
            return normed, new_residual
        return torch_ref.add_rms_norm(x, residual, weight, eps)

    def apply_rotary(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key in place (torch_ref.apply_rotary allows it): use the returned tensors."""
        if (
            query.dim() == key.dim() == 3
            and query.stride(-1) == key.stride(-1) == cos.stride(-1) == 1
            and cos.stride() == sin.stride()
            and not torch.compiler.is_compiling()
        ):
            rotated_query, rotated_key = named("fused_apply_rotary", self.kernels.fused_apply_rotary)(
                query, key, cos, sin
            )
            return rotated_query, rotated_key
        return torch_ref.apply_rotary(query, key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and not torch.compiler.is_compiling():
            return named("fused_silu_and_mul", self.kernels.fused_silu_and_mul)(x)
        return torch_ref.silu_and_mul(x)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """One memcpy per row (any dtype); raises on a slot outside the cache."""
        if _can_write(slot_mapping, key_cache, value_cache):
            named("write_kv_cache", self.kernels.write_kv_cache)(key, value, key_cache, value_cache, slot_mapping)
            return
        torch_ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def write_latent_cache(self, latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if _can_write(slot_mapping, latent_cache):
            named("write_latent_cache", self.kernels.write_latent_cache)(latent, latent_cache, slot_mapping)
            return
        torch_ref.write_latent_cache(latent, latent_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        forward_metadata: TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """torch_ref.paged_attention: decode by the decode kernel, any other step in one call of the
        prefill kernel, which takes the step's own K/V from the layer."""
        return self._attention(
            query, key, value, key_cache, value_cache, block_table, forward_metadata, scale, sliding_window, None
        )

    def paged_attention_with_sinks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        forward_metadata: TorchAttentionMetadata,
        scale: float,
        sinks: torch.Tensor,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return self._attention(
            query, key, value, key_cache, value_cache, block_table, forward_metadata, scale, sliding_window, sinks
        )

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        caches = (key_cache, value_cache, block_table)
        if metadata.is_decode_shaped:
            return paged_decode_attention(query, *caches, metadata.seq_lens, scale, sliding_window or 0, sinks)
        if torch.compiler.is_compiling():
            lengths = (metadata.query_ends_list, metadata.seq_lens_list)
            return torch_ref.per_request_prefill_attention(
                query, key, value, *caches, *lengths, scale, sliding_window, sinks
            )
        kernel = named("paged_prefill_attention", self.kernels.paged_prefill_attention)
        return kernel(
            query, key, value, *caches, metadata.query_ends, metadata.seq_lens, scale, sliding_window or 0, sinks
        )


def _can_write(slot_mapping: torch.Tensor, *caches: torch.Tensor) -> bool:
    """The C++ cache writes take contiguous caches and int64 slots, and no compiler traces them."""
    return (
        slot_mapping.dtype == torch.int64
        and all(cache.is_contiguous() for cache in caches)
        and not torch.compiler.is_compiling()
    )
