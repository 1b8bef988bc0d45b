"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping; the stacked routed experts for every expert's gate_proj, up_proj
and down_proj); a plan names checkpoint modules, so each layer takes the scheme of its parts, which
must agree since they run as one matmul (or one grouped op). Routers stay unquantized, as
compressed-tensors recipes leave them. An embedding takes a scheme only where the plan names it (as
transformers' class "Embedding" or by its name, never by the "Linear" class); an LM head tied to it
runs the embedding's scheme on the embedding's tensors. A plan's KV cache scheme (C8) goes to every
KVCacheLayer, before the cache is sized from their specs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import BLOCK, KVCacheScheme, LinearScheme, QuantizationPlan
from module.attention import STATIC_KV_SCALES, KVCacheLayer
from module.embedding import ParallelLMHead, VocabParallelEmbedding
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
    modules = dict(model.named_modules())
    embeddings = {
        name: module
        for name, module in modules.items()
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    }
    tables = {id(table.weight): name for name, table in embeddings.items()}  # before the tables change
    ties = {name: tables.get(id(head.weight)) for name, head in modules.items() if isinstance(head, ParallelLMHead)}
    layers = [_quantize_embedding(name, module, plan, compute_dtype) for name, module in embeddings.items()]
    for name, module in modules.items():
        if name in embeddings:
            continue
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
        tied = ties.get(name)
        if tied is not None:
            layers.append(_quantize_tied(name, module, tied, embeddings[tied], plan, backend, compute_dtype))
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
    return [layer for layer in layers if layer is not None]


def _quantize_embedding(
    name: str, module: VocabParallelEmbedding, plan: QuantizationPlan, compute_dtype: torch.dtype
) -> QuantizedLayer | None:
    """A token table the plan names: it keeps the checkpoint's quantized tensors and dequantizes the
    rows it looks up (schemes quantized at load leave tables alone, as llm-compressor's do)."""
    scheme = plan.scheme_for(name, "Embedding")
    if scheme is None or plan.at_load:
        return None
    if scheme.weights.strategy == BLOCK or scheme.input_activations is not None:
        raise QuantizationError(f"{plan.source}: {name} (an embedding) cannot look rows up under {scheme.describe()}")
    module.set_scheme(scheme, None, compute_dtype, at_load=False)
    return QuantizedLayer(name, (name,), scheme)


def _quantize_tied(
    name: str,
    module: QuantizableLinear,
    table_name: str,
    table: VocabParallelEmbedding,
    plan: QuantizationPlan,
    backend: Backend,
    compute_dtype: torch.dtype,
) -> QuantizedLayer | None:
    """An LM head tied to embedding `table_name`: the table's scheme on the table's tensors, which a
    scheme of its own in the plan (other than the table's) would contradict."""
    own = plan.scheme_for(name)
    if own is not None and own != table.scheme and not (plan.at_load and table.scheme is None):
        raise QuantizationError(
            f"{plan.source}: {name} is tied to {table_name}, so it runs the embedding's weights "
            f"({table.scheme.describe() if table.scheme else 'unquantized'}), not {own.describe()}"
        )
    if table.scheme is None:
        if own is None or not plan.at_load:
            return None
        # quantized at load on its own: the head's copy of the table is rounded, the table stays
        module.set_scheme(own, backend.linear_method(own.kind), compute_dtype, True)
        return QuantizedLayer(name, (name,), own)
    module.set_scheme(table.scheme, backend.linear_method(table.scheme.kind), compute_dtype, False, tied_to=table)
    return QuantizedLayer(name, (table_name,), table.scheme)


def layer_kind_schemes(model: nn.Module) -> dict[str, str]:
    """Each linear layer kind (qkv_proj, down_proj, lm_head, ...) -> its scheme and the method that
    runs it, for the start-up log and summary.json; kinds whose layers differ list each variant."""
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear):
            continue
        scheme = getattr(module, "scheme", None)
        method = getattr(module, "linear_method", None)
        if method is None and scheme is None:  # an unquantized token table: no matmul
            continue
        how = "rows dequantized as they are looked up" if method is None else method.describe(module)
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
        method = getattr(module, "linear_method", None) or getattr(module, "experts_method", None)
        how = (layer.scheme.describe(), "rows dequantized as looked up" if method is None else method.describe(module))
        kind = layer.name.rpartition(".")[2]
        if kind not in kinds.setdefault(how, []):
            kinds[how].append(kind)
    return [f"{', '.join(names)}: {scheme}; {how}" for (scheme, how), names in kinds.items()]
