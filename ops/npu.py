"""torch_npu implementations of the ops (Atlas A2/A3), as laid out in shared/npu-api-facts.md §3.

The ops are methods of an object that holds the torch_npu module it was given: make_backend
(ops/backend.py) imports torch_npu once (through executor.platform) and puts the methods in the NPU
record, so no forward pass calls an import helper and a dynamo trace sees plain attribute calls.
The paged K/V's write and attention (FIA) are the NPU's attention backend, ops/attention/npu.py.
Unverified on hardware.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ops import quant_math, torch_ref

# npu_apply_rotary_pos_emb handles q and k in one kernel but only for these head dims.
_FUSED_ROTARY_HEAD_DIMS = (64, 128)


class NpuOps:
    """torch_npu's kernels (eager and graph modes alike)."""

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
    """ge_graph / npugraph_ex: the same kernels (their FIA attention through torchair's variant:
    ops/attention/npu.py's NpuGraphAttention)."""

    def __init__(self, torch_npu: ModuleType, torchair: ModuleType) -> None:
        super().__init__(torch_npu)
        self.torchair = torchair
