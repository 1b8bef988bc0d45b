"""torch_npu implementations of the ops (Atlas A2/A3), as laid out in shared/npu-api-facts.md §3.

The ops are methods of an object that holds the torch_npu module it was given: make_backend
(ops/backend.py) imports torch_npu once (through executor.platform) and puts the methods in the NPU
record, so no forward pass calls an import helper and a dynamo trace sees plain attribute calls.
Eager mode calls torch_npu's FIA with host lists; the graph modes call torchair's variant, which
takes the lengths as tensors.

A C8 cache with static scales (per channel, [Hkv, D]) is written quantized in torch and read by FIA
with its antiquant scales per channel (key/value_antiquant_scale [Hkv * D], antiquant mode 0, the
BnBsH layout's channels); per-token-head scales (dynamic C8) are refused here: the FIA modes that take
them are not in shared/npu-api-facts.md. Unverified on hardware.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ops import quant_math, torch_ref
from ops.attention_metadata import NpuAttentionMetadata

# npu_apply_rotary_pos_emb handles q and k in one kernel but only for these head dims.
_FUSED_ROTARY_HEAD_DIMS = (64, 128)
_NO_LIMIT = 2147483647  # FIA's default pre_tokens / next_tokens
_PER_CHANNEL = 0  # FIA's key/value_antiquant_mode for one scale per channel


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


class NpuOps:
    """Eager mode: torch_npu's kernels, FIA with host int lists."""

    def __init__(self, torch_npu: ModuleType) -> None:
        self.torch_npu = torch_npu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.torch_npu.npu_rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _, new_residual = self.torch_npu.npu_add_rms_norm(x, residual, weight, eps)
        return normed, new_residual

    def apply_rotary(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BSND with B=1: query [1, T, H, D], cos [1, T, 1, D]."""
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        query, key = query.contiguous().unsqueeze(0), key.contiguous().unsqueeze(0)
        if query.shape[-1] in _FUSED_ROTARY_HEAD_DIMS:
            self.torch_npu.npu_apply_rotary_pos_emb(query, key, cos, sin)  # rotates query and key in place
        else:
            query, key = self.torch_npu.npu_rotary_mul(query, cos, sin), self.torch_npu.npu_rotary_mul(key, cos, sin)
        return query[0], key[0]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.torch_npu.npu_swiglu(x, dim=-1)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference: shared/npu-api-facts.md names no fused GeGLU kernel."""
        return torch_ref.gelu_tanh_and_mul(x)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> None:
        if key_cache.dtype == torch.int8:
            key_scale, value_scale = _static_scales(key_scale, value_scale)
            key, value = (
                quant_math.quantize_kv_static(key, key_scale),
                quant_math.quantize_kv_static(value, value_scale),
            )
        self.torch_npu.npu_scatter_pa_kv_cache(
            key.contiguous(), value.contiguous(), key_cache, value_cache, slot_mapping, cache_mode="Norm"
        )

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        forward_metadata: NpuAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One fused call for every step shape (prefill, chunk, decode, verify), as vllm-ascend does.

        TND with paged KV takes cumulative query ends but per-request KV lengths, and the cache as
        [num_blocks, block_size, Hkv * D]; FIA reads the step's own K/V from there, where
        write_kv_cache has put them, so `key` and `value` go unused. The metadata's mask and sparse
        mode follow the step's longest query. A sliding window uses the band mode (sparse_mode 4, pre_tokens = window,
        next_tokens 0) on steps with a mask and only pre_tokens = window in decode, as vllm-ascend
        does; unverified on hardware. An int8 cache adds its antiquant scales (the module docstring).
        """
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        antiquant: dict[str, Any] = {}
        if key_cache.dtype == torch.int8:
            key_scale, value_scale = _static_scales(key_scale, value_scale)
            antiquant = {
                "key_antiquant_scale": key_scale.reshape(-1).to(query.dtype),
                "value_antiquant_scale": value_scale.reshape(-1).to(query.dtype),
                "key_antiquant_mode": _PER_CHANNEL,
                "value_antiquant_mode": _PER_CHANNEL,
            }
        sparse_mode, pre_tokens, next_tokens = forward_metadata.sparse_mode, _NO_LIMIT, _NO_LIMIT
        if sliding_window is not None:
            pre_tokens = sliding_window
            if forward_metadata.atten_mask is not None:  # band mode; decode keeps next_tokens open
                sparse_mode, next_tokens = 4, 0
        output, _ = self.fused_infer_attention_score(
            query,
            key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            atten_mask=forward_metadata.atten_mask,
            block_table=block_table,
            actual_seq_lengths=forward_metadata.actual_seq_lengths_q,
            actual_seq_lengths_kv=forward_metadata.actual_seq_lengths_kv,
            num_heads=query.shape[1],
            num_key_value_heads=num_kv_heads,
            scale=scale,
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

    def moe_experts_int8(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        gate_up_t: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down_t: torch.Tensor,
        down_scale: torch.Tensor,
        gate_up_input_scale: torch.Tensor | None = None,
        down_input_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """torch_ref.moe_experts_int8 as npu_grouped_matmul's MoE form (shared/npu-api-facts.md §3,
        cann's gmm_quant_mode): the routed rows sorted by expert, quantized to int8 per row here in
        torch (dynamic per token, or by the row's expert's static scale), then per projection one
        call with weight [E, K, N] int8, scale [per-channel scales [E, N]], per_token_scale [the
        rows' scales], group_list the per-expert counts (group_list_type 1), group_type 0 (split M),
        split_item 2 (one output). UNVERIFIED on hardware: the dtypes the kernel takes for scale and
        per_token_scale (fp32 here), and output_dtype as a torch dtype (vllm-ascend passes one; the
        yaml says int?)."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)
        tokens = order // top_k
        counts = torch.bincount(flat_ids, minlength=gate_up_t.shape[0])
        row_experts = flat_ids[order]
        gate_up = self._grouped_int8(
            hidden_states[tokens], gate_up_t, gate_up_scale, counts, row_experts, gate_up_input_scale
        )
        down = self._grouped_int8(self.silu_and_mul(gate_up), down_t, down_scale, counts, row_experts, down_input_scale)
        weighted = down * topk_weights.flatten()[order, None].to(down.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, tokens, weighted)

    def _grouped_int8(
        self,
        rows: torch.Tensor,
        weight_t: torch.Tensor,
        scale: torch.Tensor,
        counts: torch.Tensor,
        row_experts: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        if input_scale is None:
            values, row_scale = quant_math.quantize_int8_per_token(rows)
        else:
            row_scale = input_scale.float()[row_experts].reshape(-1, 1)
            values = quant_math.quantize_int8(rows, row_scale)
        return self.torch_npu.npu_grouped_matmul(
            [values],
            [weight_t],
            scale=[scale.float()],
            per_token_scale=[row_scale.reshape(-1)],
            group_list=counts,
            group_list_type=1,
            group_type=0,
            split_item=2,
            output_dtype=rows.dtype,
        )[0]


class NpuGraphOps(NpuOps):
    """ge_graph / npugraph_ex: the same kernels, but FIA through torchair's variant, whose sequence
    lengths are int64 device tensors, so the graph holds no host list that changes every step."""

    def __init__(self, torch_npu: ModuleType, torchair: ModuleType) -> None:
        super().__init__(torch_npu)
        self.torchair = torchair

    def fused_infer_attention_score(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.torchair.ops.npu_fused_infer_attention_score(*args, **kwargs)
