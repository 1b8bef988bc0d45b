"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping); a plan names checkpoint modules, so each layer takes the scheme of
its parts, which must agree since they run as one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.quant_scheme import LinearScheme, QuantizationPlan
from module.moe import FusedExperts, Router
from module.quantized import QuantizableLinear, QuantizationError, fused_parts
from ops.backend import Backend

# Layers with weights that a checkpoint might quantize but that hold plain ones here.
UNQUANTIZABLE = (FusedExperts, Router)


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
        parts = fused_parts(name, mapping)
        schemes = {plan.scheme_for(part) for part in parts}
        if not isinstance(module, QuantizableLinear):
            if isinstance(module, UNQUANTIZABLE) and schemes != {None}:
                raise QuantizationError(
                    f"{plan.source}: {name} ({type(module).__name__}) is quantized by the plan, which this layer "
                    "does not run; add it to the quantization_config's ignore list"
                )
            continue
        if len(schemes) > 1:
            raise QuantizationError(
                f"{plan.source}: {name} runs {', '.join(parts)} as one matmul, but their schemes differ"
            )
        scheme = schemes.pop()
        if scheme is None:
            continue
        module.set_scheme(scheme, backend.linear_method(scheme.kind), compute_dtype, plan.at_load)
        layers.append(QuantizedLayer(name, tuple(parts), scheme))
    return layers


def describe_quantized_layers(model: nn.Module, layers: list[QuantizedLayer]) -> list[str]:
    """One line per layer kind (qkv_proj, down_proj, ...) and way it runs: its scheme and whether
    its method runs it natively or dequantized it at load, and why (after process_weights)."""
    modules = dict(model.named_modules())
    kinds: dict[tuple[str, str], list[str]] = {}
    for layer in layers:
        module = modules[layer.name]
        how = (layer.scheme.describe(), module.linear_method.describe(module))
        kind = layer.name.rpartition(".")[2]
        if kind not in kinds.setdefault(how, []):
            kinds[how].append(kind)
    return [f"{', '.join(names)}: {scheme}; {how}" for (scheme, how), names in kinds.items()]
