"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping; the stacked routed experts for every expert's gate_proj, up_proj
and down_proj); a plan names checkpoint modules, so each layer takes the scheme of its parts, which
must agree since they run as one matmul (or one grouped op). Routers stay unquantized, as
compressed-tensors recipes leave them. A plan's KV cache scheme (C8) goes to every KVCacheLayer,
before the cache is sized from their specs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import KVCacheScheme, LinearScheme, QuantizationPlan
from module.attention import STATIC_KV_SCALES, KVCacheLayer
from module.moe import FusedExperts, Router
from module.quantized import QuantizableLinear, QuantizationError, fused_parts, shape_problem
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
    if plan.kv_cache is not None:
        set_kv_cache_schemes(model, plan.kv_cache)
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
                problem = shape_problem(scheme.weights, *module.weight.shape)
                if problem is not None:
                    raise WeightLoadError(problem)
                method = backend.dequantized_linear() if module.reads_dense_weight else None
                module.set_scheme(scheme, method or backend.linear_method(scheme.kind), compute_dtype, plan.at_load)
        except WeightLoadError as error:
            raise QuantizationError(f"{plan.source}: layer {name} ({scheme.describe()}): {error}") from None
        layers.append(QuantizedLayer(name, tuple(part for part, _ in parts), scheme))
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
