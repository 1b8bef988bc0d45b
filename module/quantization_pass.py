"""The pass that gives each layer of a built model its quantization scheme, before its weights load.

Our fused layers stand for several checkpoint modules (qkv_proj for q_proj, k_proj and v_proj: the
model's packed_modules_mapping); a plan names checkpoint modules, so each layer takes the scheme of
its parts, which must agree since they run as one matmul. An embedding takes a scheme only where
the plan names it (as transformers' class "Embedding" or by its name, never by the "Linear" class);
an LM head tied to it runs the embedding's scheme on the embedding's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor.types_.quant_scheme import BLOCK, LinearScheme, QuantizationPlan
from module.embedding import ParallelLMHead, VocabParallelEmbedding
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
        parts = fused_parts(name, mapping)
        schemes = {plan.scheme_for(part) for part in parts}
        if not isinstance(module, QuantizableLinear):
            if isinstance(module, UNQUANTIZABLE) and schemes != {None}:
                raise QuantizationError(
                    f"{plan.source}: {name} ({type(module).__name__}) is quantized by the plan, which this layer "
                    "does not run; add it to the quantization_config's ignore list"
                )
            continue
        tied = ties.get(name)
        if tied is not None:
            layers.append(_quantize_tied(name, module, tied, embeddings[tied], plan, backend, compute_dtype))
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
    if own is not None and own != table.scheme:
        raise QuantizationError(
            f"{plan.source}: {name} is tied to {table_name}, so it runs the embedding's weights "
            f"({table.scheme.describe() if table.scheme else 'unquantized'}), not {own.describe()}"
        )
    if table.scheme is None:
        return None
    module.set_scheme(table.scheme, backend.linear_method(table.scheme.kind), compute_dtype, False, tied_to=table)
    return QuantizedLayer(name, (table_name,), table.scheme)
