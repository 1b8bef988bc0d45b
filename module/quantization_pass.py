"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping); a plan names checkpoint modules, so each layer takes the scheme of
its parts, which must agree since they run as one matmul.
"""

from __future__ import annotations

import dataclasses
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


def layer_kind_schemes(model: nn.Module) -> dict[str, str]:
    """Each linear layer kind (qkv_proj, down_proj, lm_head, ...) -> its scheme and the method that
    runs it, for the start-up log and summary.json; kinds whose layers differ list each variant."""
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear):
            continue
        scheme = getattr(module, "scheme", None)
        method = type(module.linear_method).__name__
        described = f"{scheme.describe()} ({method})" if scheme is not None else f"unquantized ({method})"
        kinds.setdefault(name.rpartition(".")[2], set()).add(described)
    return {kind: "; ".join(sorted(variants)) for kind, variants in kinds.items()}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (each shared one once) and of the copies its kernels laid out."""
    tensors = list(model.parameters())
    for module in model.modules():
        copy = getattr(module, "packed_weight", None)
        if dataclasses.is_dataclass(copy):
            tensors += [getattr(copy, f.name) for f in dataclasses.fields(copy)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
