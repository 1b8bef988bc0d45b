"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping); a plan names checkpoint modules, so each layer takes the scheme of
its parts, which must agree since they run as one matmul. A plan's KV cache scheme (C8) goes to every
KVCacheLayer, before the cache is sized from their specs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.quant_scheme import KVCacheScheme, LinearScheme, QuantizationPlan
from module.attention import STATIC_KV_SCALES, KVCacheLayer
from module.moe import FusedExperts, Router
from module.quantized import QuantizableLinear, QuantizationError, fused_parts, shape_problem
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
    if plan.kv_cache is not None:
        set_kv_cache_schemes(model, plan.kv_cache)
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
        problem = shape_problem(scheme.weights, *module.weight.shape)
        if problem is not None:
            raise QuantizationError(f"{plan.source}: {name} ({scheme.describe()}): {problem}")
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
        how = module.linear_method.describe(module)
        described = f"{scheme.describe()}; {how}" if scheme is not None else f"unquantized; {how}"
        kinds.setdefault(name.rpartition(".")[2], set()).add(described)
    return {kind: "; ".join(sorted(variants)) for kind, variants in kinds.items()}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each shared one once) and of the copies its kernels laid out."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        copy = getattr(module, "packed_weight", None)
        if dataclasses.is_dataclass(copy):
            tensors += [getattr(copy, f.name) for f in dataclasses.fields(copy)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def set_kv_cache_schemes(model: nn.Module, scheme: KVCacheScheme) -> None:
    """Give every KVCacheLayer the C8 `scheme`. Static scales are registered where compressed-tensors
    names them, on the checkpoint's attention module (model.layers.0.self_attn.k_scale): the layer
    itself (MLA) or, for an Attention held as `attn` by the model's own attention module (the Llama
    family), that module."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not isinstance(module, KVCacheLayer):
            continue
        parent, _, local_name = name.rpartition(".")
        owner = modules[parent] if local_name == "attn" else module
        params = module.set_kv_cache_scheme(scheme)
        if params and owner is not module:
            for param_name, param in zip(STATIC_KV_SCALES, params, strict=True):
                owner.register_parameter(param_name, param)


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
