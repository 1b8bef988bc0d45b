"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping; the stacked routed experts for every expert's gate_proj, up_proj
and down_proj); a plan names checkpoint modules, so each layer takes the scheme of its parts, which
must agree since they run as one matmul (or one grouped op). Routers stay unquantized, as
compressed-tensors recipes leave them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import LinearScheme, QuantizationPlan
from module.moe import FusedExperts, Router
from module.quantized import QuantizableLinear, QuantizationError, fused_parts
from ops.backend import Backend


@dataclass(frozen=True, slots=True)
class QuantizedLayer:
    """One layer a plan quantized: our module's name, the checkpoint modules it stands for, its scheme."""

    name: str
    checkpoint_names: tuple[str, ...]
    scheme: LinearScheme


def quantize_model(
    model: nn.Module, plan: QuantizationPlan, backend: Backend, compute_dtype: torch.dtype
) -> list[QuantizedLayer]:
    """Give every linear layer that `plan` quantizes its scheme and its backend's method for it (before
    the weights load); a fused layer whose parts' schemes differ, or a layer kind that holds no
    quantized weights yet, is refused with its name."""
    mapping = getattr(model, "packed_modules_mapping", {})
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            parts = module.checkpoint_modules(name)
        elif isinstance(module, (QuantizableLinear, Router)):
            parts = [(part, "Linear") for part in fused_parts(name, mapping)]
        else:
            continue
        schemes = {plan.scheme_for(part, class_name) for part, class_name in parts}
        if isinstance(module, Router):
            if schemes != {None}:
                raise QuantizationError(
                    f"{plan.source}: {name} ({type(module).__name__}) is a router, which runs unquantized here "
                    "(compressed-tensors recipes ignore them); add it to the quantization_config's ignore list"
                )
            continue
        if len(schemes) > 1:
            names = [part for part, _ in parts]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise QuantizationError(f"{plan.source}: {name} runs {shown} as one matmul, but their schemes differ")
        scheme = schemes.pop()
        if scheme is None:
            continue
        try:
            if isinstance(module, FusedExperts):
                module.set_scheme(scheme, backend.experts_method(scheme.kind), compute_dtype, plan.at_load)
            else:
                method = backend.dequantized_linear() if module.reads_dense_weight else None
                module.set_scheme(scheme, method or backend.linear_method(scheme.kind), compute_dtype, plan.at_load)
        except WeightLoadError as error:
            raise QuantizationError(f"{plan.source}: layer {name} ({scheme.describe()}): {error}") from None
        layers.append(QuantizedLayer(name, tuple(part for part, _ in parts), scheme))
    return layers
