"""Operators behind one dispatch: every op has a torch reference (ops.torch_ref, which defines what
it computes) and, where the device has a fused kernel, an NPU implementation (ops.npu). Layers
call only the functions exported here; the table behind them is chosen by (backend, exe_mode).

Shapes use the packed TND layout: T tokens of the whole batch, H heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ops import torch_ref
from ops.dispatch import current_table, implementation, make_op_table, set_backend

P = ParamSpec("P")
R = TypeVar("R")


def _dispatched(reference: Callable[P, R]) -> Callable[P, R]:
    """The public op: the reference's signature and docstring, the current table's body."""
    name = reference.__name__

    @functools.wraps(reference)
    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(implementation(), name)(*args, **kwargs)

    return op


rms_norm = _dispatched(torch_ref.rms_norm)
add_rms_norm = _dispatched(torch_ref.add_rms_norm)
apply_rotary = _dispatched(torch_ref.apply_rotary)
silu_and_mul = _dispatched(torch_ref.silu_and_mul)
write_kv_cache = _dispatched(torch_ref.write_kv_cache)
paged_attention = _dispatched(torch_ref.paged_attention)
write_latent_cache = _dispatched(torch_ref.write_latent_cache)
mla_attention = _dispatched(torch_ref.mla_attention)
moe_experts = _dispatched(torch_ref.moe_experts)
paged_attention_with_sinks = _dispatched(torch_ref.paged_attention_with_sinks)
moe_experts_clamped_swiglu = _dispatched(torch_ref.moe_experts_clamped_swiglu)

OPS = ("rms_norm", "add_rms_norm", "apply_rotary", "silu_and_mul", "write_kv_cache", "paged_attention")
# Ops with a torch reference only so far (MLA and MoE for DeepSeek-V3; attention sinks and biased
# clamped-SwiGLU experts for gpt-oss): the NPU table lacks them, so a model that calls them checks
# missing_ops() at construction instead of failing mid-run.
OPS_WITHOUT_NPU = (
    "write_latent_cache",
    "mla_attention",
    "moe_experts",
    "paged_attention_with_sinks",
    "moe_experts_clamped_swiglu",
)


def missing_ops(names: tuple[str, ...]) -> list[str]:
    """Which of `names` the current op table does not implement."""
    table = current_table().ops
    return [name for name in names if not callable(getattr(table, name, None))]


__all__ = [*OPS, *OPS_WITHOUT_NPU, "current_table", "make_op_table", "missing_ops", "set_backend"]
