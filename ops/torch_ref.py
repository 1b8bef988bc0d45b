"""Torch reference for every op but attention: the definition of what each op computes, and CUDA's
eager path. Attention's is ops/attention/reference.py; the linear attentions' are ops/recurrent_ref.py
and ops/kda.py; ops/backend.py's REFERENCE_OPS names each op's reference in one table.

Pure definitions: no device, dtype, compiling or capture check. A backend (ops/backend.py) that has a
faster form of an op (the CPU's C++ kernels, ops/cpu.py) says so in its own record.

Numerics follow Hugging Face (RMSNorm in fp32 then cast back, weight applied after the cast) so
that fp32 parity tests hold to 1e-4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops import cuda_quant, quant_math


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """scores.argmax(dim=-1): each row's first maximum, NaN above all, through max(dim=-1), which
    picks the same index on every input and runs 2.3x faster on CPU (0.48 against 1.09 ms over 32 x
    49,152 logits on two cores: a verify step's greedy rows)."""
    return scores.max(dim=-1).indices


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the new residual comes out of the same pass."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, Hkv, D] by cos/sin [T, D] (HF rotate_half convention).

    Use the returned tensors; an implementation may rotate its inputs in place (the CPU's fused
    kernel does).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, with the gate in the first half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_silu_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    """[T, 2I] -> [T, I], gate first: silu(gate) clamped from above at `limit`, times up clamped to
    [-limit, limit] (Step-3.7-Flash's SwiGLU on its last layers, as transformers computes it)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: gelu(gate) with the tanh approximation (transformers' gelu_pytorch_tanh) times
    up, gate in the first half: Gemma's GeGLU."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def moe_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Routed experts: each token [T, H] through its top-k SwiGLU experts, summed with its weights.

    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; topk_ids/topk_weights [T, K].
    """
    return grouped_experts(hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj)


def moe_experts_clamped_swiglu(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """moe_experts with gpt-oss's experts: biased projections (gate_up_bias [E, 2I], down_bias
    [E, H]) and clamped_swiglu(alpha, limit) in place of silu(gate) * up; same layouts otherwise."""
    return grouped_experts(
        hidden_states,
        topk_weights,
        topk_ids,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        activation="clamped_swiglu",
        alpha=alpha,
        limit=limit,
    )


def moe_experts_clamped_silu(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """moe_experts with clamped_silu_and_mul(limit) in place of silu(gate) * up; same layouts."""
    return grouped_experts(
        hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj, activation="clamped_silu", limit=limit
    )


def moe_experts_clamped_gate_silu(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """moe_experts with DeepSeek-V4's experts: silu(gate) * up with the gate clamped from above at
    `limit` before the SiLU and up to [-limit, limit] (clamped_gate_silu_and_mul); same layouts."""
    return grouped_experts(
        hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj, activation="clamped_gate_silu", limit=limit
    )


def clamped_gate_silu_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    """[T, 2I] -> [T, I], gate first: silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4;
    Step-3.7-Flash's clamped_silu_and_mul clamps after the SiLU instead)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def moe_experts_gelu_tanh(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """moe_experts with GeGLU experts (gelu_tanh_and_mul in place of silu(gate) * up; Gemma 4); same layouts."""
    return grouped_experts(hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj, activation="gelu_tanh")


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2I] -> [T, I], gate first: (up + 1) * gate * sigmoid(alpha * gate), with the gate clamped
    from above at `limit` and up to [-limit, limit] (gpt-oss's experts, as transformers computes them)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def run_grouped(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_forward: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Tokens grouped by expert with one sort, then expert_forward(expert, its tokens [n, H]) once per
    expert that any token chose, its output weighted and summed into each token's row. The counts
    are read on the host, so callers are opaque custom ops (as the reference's decode attention is): a
    compiled decode keeps one graph."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = topk_weights.flatten()
    output = torch.zeros_like(hidden_states)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start : start + count]
        start += count
        tokens = picks // top_k
        expert_out = expert_forward(expert, hidden_states[tokens])
        output.index_add_(0, tokens, (expert_out * flat_weights[picks, None]).to(output.dtype))
    return output


@torch.library.custom_op("infer_recipes::grouped_experts", mutates_args=())
def grouped_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """The body of every moe_experts op: one matmul pair per expert over its tokens only (run_grouped),
    adding the biases that are given, with the gated activation named by `activation`: "silu"
    (silu(gate) * up), "gelu_tanh" (gelu_tanh_and_mul), "clamped_swiglu" (clamped_swiglu(alpha,
    limit)), "clamped_silu" (clamped_silu_and_mul(limit)) or "clamped_gate_silu"
    (clamped_gate_silu_and_mul(limit)). A name, not a function: a custom op takes no callable."""
    activations: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": silu_and_mul,
        "gelu_tanh": gelu_tanh_and_mul,
        "clamped_swiglu": functools.partial(clamped_swiglu, alpha=alpha, limit=limit),  # type: ignore[arg-type]
        "clamped_silu": functools.partial(clamped_silu_and_mul, limit=limit),  # type: ignore[arg-type]
        "clamped_gate_silu": functools.partial(clamped_gate_silu_and_mul, limit=limit),  # type: ignore[arg-type]
    }
    return experts_with_activation(
        hidden_states, topk_weights, topk_ids, gate_up_proj, down_proj, gate_up_bias, down_bias, activations[activation]
    )


def experts_with_activation(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """grouped_experts with the gated activation given: [n, 2I] -> [n, I] (a backend passes its
    fused form of silu_and_mul)."""

    def expert_forward(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, gate_up_proj[expert], None if gate_up_bias is None else gate_up_bias[expert])
        return F.linear(activation(gate_up), down_proj[expert], None if down_bias is None else down_bias[expert])

    return run_grouped(hidden_states, topk_weights, topk_ids, gate_up_proj.shape[0], expert_forward)


@grouped_experts.register_fake
def _(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(hidden_states)  # only the output's shape and dtype: those of hidden_states


def _int8_rows(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [n, K] -> (int8 values, fp32 scale [n, 1] or [1, 1]): per token, or the static scale."""
    if input_scale is None:
        return quant_math.quantize_int8_per_token(x)
    scale = input_scale.float().reshape(1, 1)
    return quant_math.quantize_int8(x, scale), scale


def _int8_linear(x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None):
    """q(x) @ W_q^T * s_x * s_w in fp32; weight_t int8 [K, N], scale [N]. torch._int_mm's CUDA form
    takes more than 16 rows (ops/cuda_quant.py)."""
    values, x_scale = _int8_rows(x, input_scale)
    int_mm = torch._int_mm if values.is_cpu else cuda_quant.padded_int_mm
    return int_mm(values, weight_t).float() * x_scale * scale


@torch.library.custom_op("infer_recipes::grouped_experts_int8", mutates_args=())
def moe_experts_int8(
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
    """moe_experts with W8A8 int8 experts: gate_up_t [E, H, 2I] and down_t [E, I, H] int8 (transposed
    for the int8 matmul), per-channel scales [E, 2I] and [E, H]; each expert's tokens quantized per
    token (or by the expert's static input scale [E]) before each of its two int8 matmuls."""

    def expert_forward(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up_in = None if gate_up_input_scale is None else gate_up_input_scale[expert]
        down_in = None if down_input_scale is None else down_input_scale[expert]
        gate_up = _int8_linear(x, gate_up_t[expert], gate_up_scale[expert], gate_up_in).to(x.dtype)
        return _int8_linear(silu_and_mul(gate_up), down_t[expert], down_scale[expert], down_in).to(x.dtype)

    return run_grouped(hidden_states, topk_weights, topk_ids, gate_up_t.shape[0], expert_forward)


@moe_experts_int8.register_fake
def _(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(hidden_states)
