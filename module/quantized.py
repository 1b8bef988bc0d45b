"""Quantized linear layers: the parameters a scheme gives a layer, how checkpoint tensors decode into
them, and the pass that gives each layer of a model its scheme.

A layer keeps its checkpoint's tensors in the layout compressed-tensors writes them, decoded at
load into plain ones (so tensor parallelism cuts them like any other tensor):
- `weight` [N, K]: int8 values (int-quantized; pack-quantized's int32 words unpacked), float8
  values (float-quantized, mxfp8), or fp4 values as floats (mxfp4's packed bytes);
- `weight_scale`: [N, 1] per tensor or channel (a per-tensor scale is spread over its rows, so that
  fused q/k/v keep their own), [N, K/g] per group, [N/b0, K/b1] per block; e8m0 bytes decode to floats;
- `weight_zero_point` like the scale (pack-quantized's int32 words along N unpacked), when asymmetric;
- `weight_offset` like the scale, fp32, where a scheme adds a float offset instead (GGUF's Q4_1 blocks:
  `weight` holds uint8 codes 0..15 and w = q * scale + offset);
- `input_scale` [1], static activations: fused projections see the same input, so they share the
  largest of their parts' scales (calibration makes them equal).
Column layers cut all of these along N; row layers cut the weight along K and group/block scales
with it, and hold per-channel scales whole. ops/quantized_linear.py multiplies them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from torch import nn

from executor.types_.checkpoint_tensor import LoadedWeight, materialize
from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import BLOCK, FLOAT, GROUP, INT, LinearScheme, QuantArgs
from module.weights import WeightLoader, load_shard, set_weight_loader
from ops.linear_method import LinearMethod
from ops.quant_math import block_shape, group_size

logger = logging.getLogger(__name__)

# Tensors a checkpoint's quantized layer may hold, by name suffix, besides `weight`.
QUANT_TENSORS = ("weight_scale", "weight_zero_point", "weight_offset", "input_scale")
# compressed-tensors names that decode into `weight` / that carry no data we need.
CHECKPOINT_ALIASES = {"weight_packed": "weight"}
CHECKPOINT_IGNORED = ("weight_shape", "weight_global_scale", "input_zero_point")


class QuantizationError(WeightLoadError):
    """A quantization scheme that cannot run where it is asked for, named with the plan's source."""


@dataclass(frozen=True, slots=True)
class QuantParam:
    """How one quantized parameter loads: which dim tensor parallelism cuts (None: whole on every
    rank), how many weight rows one of its rows covers (block scales), how a checkpoint tensor of
    another dtype decodes into it, and how fused parts combine (max for a shared input scale)."""

    tp_dim: int | None
    rows_per_entry: int = 1
    decode: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor] | None = None
    shared: bool = False
    # the checkpoint's values must be finite (scales, zero points, offsets), and not negative too
    # (the weight scales of a scheme with dynamic activations)
    finite: bool = True
    non_negative: bool = False


# The attribute a quantized parameter carries its QuantParam in (set_quant_param, quant_param).
QUANT = "quant"


def set_quant_param(param: nn.Parameter, spec: QuantParam) -> None:
    """Mark `param` as a quantized tensor that loads by `spec` (its layer's weight_loader reads it)."""
    setattr(param, QUANT, spec)


def quant_param(param: nn.Parameter) -> QuantParam | None:
    """How `param` loads as a quantized tensor; None for a plain parameter."""
    return getattr(param, QUANT, None)


def check_values(values: torch.Tensor, spec: QuantParam) -> None:
    """A WeightLoadError naming the first value a damaged checkpoint holds where `spec` forbids it
    (the loader prefixes the tensor's name): NaN or inf anywhere, a negative scale where not allowed."""
    if not values.is_floating_point() or not (spec.finite or spec.non_negative):
        return
    bad = ~torch.isfinite(values) if spec.finite else torch.zeros_like(values, dtype=torch.bool)
    if spec.non_negative:
        bad |= values < 0
    if bool(bad.any()):
        index = [int(i) for i in torch.nonzero(bad)[0]]
        allowed = "finite and not negative" if spec.non_negative else "finite"
        raise WeightLoadError(
            f"holds {values[tuple(index)].item()} at index {index} (the first of {int(bad.sum())}); its values "
            f"must be {allowed}: the checkpoint is damaged, quantize or fetch it again"
        )


def scale_shape(args: QuantArgs, rows: int, cols: int) -> tuple[int, int]:
    """The [N, K] weight's scale shape under `args` (per tensor and per channel both [N, 1])."""
    if args.strategy == GROUP:
        return rows, -(-cols // group_size(args))
    if args.strategy == BLOCK:
        block_rows, block_cols = block_shape(args)
        return -(-rows // block_rows), -(-cols // block_cols)
    return rows, 1


def shape_problem(args: QuantArgs, rows: int, cols: int) -> str | None:
    """Why an [rows, cols] weight cannot take `args`' groups or blocks whole, or None."""
    if args.strategy == GROUP and cols % group_size(args):
        return f"{cols} input features do not split into groups of {args.group_size}; choose a _g<N> that divides them"
    if args.strategy == BLOCK and (rows % block_shape(args)[0] or cols % block_shape(args)[1]):
        blocks = "x".join(map(str, block_shape(args)))
        return f"a [{rows}, {cols}] weight does not split into {blocks} blocks"
    return None


def weight_dtype(args: QuantArgs) -> torch.dtype:
    if args.type == INT and args.offset:
        return torch.uint8
    if args.type == INT:
        return torch.int8
    return torch.float8_e4m3fn if args.num_bits == 8 else torch.float32


def decode_weight(args: QuantArgs) -> Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]:
    """Checkpoint weight -> values [N, K]: int32 words (pack-quantized) unpacked, uint8 fp4 pairs
    (mxfp4) unpacked, int values stored as floats (naive-quantized) cast."""

    def decode(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tensor.dtype == torch.int32:
            return unpack_from_int32(tensor, args.num_bits, torch.Size(shape), packed_dim=1)
        if tensor.dtype == torch.uint8 and args.type == FLOAT and args.num_bits == 4:
            return unpack_fp4_from_uint8(tensor, shape[0], shape[1], dtype=torch.float32)
        if args.type == INT and tensor.is_floating_point():
            return tensor.round().to(torch.int8)
        return tensor

    return decode


def decode_zero_point(args: QuantArgs) -> Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]:
    """pack-quantized packs zero points along N into int32 words; others store them as ints."""

    def decode(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tensor.dtype == torch.int32 and args.num_bits < 8:
            return unpack_from_int32(tensor, args.num_bits, torch.Size(shape), packed_dim=0)
        return tensor.round().to(torch.int8) if tensor.is_floating_point() else tensor.to(torch.int8)

    return decode


def decode_scale(args: QuantArgs) -> Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]:
    """e8m0 exponents (MX) -> 2 ** (e - 127); a per-tensor scalar -> spread over the rows."""

    def decode(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if args.mx and tensor.dtype == torch.uint8:
            tensor = torch.exp2(tensor.float() - 127)
        if tensor.numel() == 1 and tuple(shape) != (1,):
            return tensor.float().reshape(1, 1).expand(shape)
        return tensor.float().reshape(shape) if tensor.numel() == torch.Size(shape).numel() else tensor.float()

    return decode


def quant_parameters(
    scheme: LinearScheme, rows: int, cols: int, tp_dim: int
) -> dict[str, tuple[nn.Parameter, QuantParam]]:
    """The checkpoint's tensors of a layer of scheme `scheme` whose shard is [rows, cols]."""
    weights = scheme.weights
    grouped = weights.strategy in (GROUP, BLOCK)
    scale_tp_dim = 0 if tp_dim == 0 else (1 if grouped else None)
    block_rows = block_shape(weights)[0] if weights.strategy == BLOCK else 1
    if tp_dim == 1 and grouped and cols % (weights.group_size or block_shape(weights)[1]):
        raise WeightLoadError(
            f"a row-parallel shard of {cols} input features does not hold whole groups of {scheme.describe()}"
        )
    shape = scale_shape(weights, rows, cols)
    inputs = scheme.input_activations
    weight_spec = QuantParam(tp_dim, 1, decode_weight(weights), finite=False)
    scale_spec = QuantParam(
        scale_tp_dim, block_rows, decode_scale(weights), non_negative=inputs is not None and inputs.dynamic
    )
    params = {
        "weight": (torch.empty(rows, cols, dtype=weight_dtype(weights)), weight_spec),
        "weight_scale": (torch.empty(shape), scale_spec),
    }
    if weights.offset:
        params["weight_offset"] = (torch.empty(shape), QuantParam(scale_tp_dim, 1))
    elif not weights.symmetric:
        decode = decode_zero_point(weights)
        params["weight_zero_point"] = (torch.empty(shape, dtype=torch.int8), QuantParam(scale_tp_dim, 1, decode))
    if inputs is not None and not inputs.dynamic:
        params["input_scale"] = (torch.zeros(1), QuantParam(None, 1, decode_scale(inputs), shared=True))
    return {name: (nn.Parameter(tensor, requires_grad=False), spec) for name, (tensor, spec) in params.items()}


def load_quant_tensor(
    destination: torch.Tensor, loaded: LoadedWeight, spec: QuantParam, tp_rank: int, tp_size: int
) -> None:
    """Decode one checkpoint tensor into (this rank's part of) a quantized parameter, once its values
    are checked (check_values)."""
    if spec.finite or spec.non_negative:
        loaded = materialize(loaded)
        check_values(loaded, spec)
    if spec.shared:
        assert spec.decode is not None, "a shared tensor (the input scale) decodes by its scheme"
        value = spec.decode(materialize(loaded), tuple(destination.shape))
        destination.copy_(torch.maximum(destination, value.reshape(destination.shape).to(destination.dtype)))
        return
    full = list(destination.shape)
    if spec.tp_dim is not None:
        full[spec.tp_dim] *= tp_size
    if loaded.dtype != destination.dtype or loaded.shape.numel() != torch.Size(full).numel():
        assert spec.decode is not None, "a tensor held in another dtype or shape than its parameter's decodes"
        decoded = spec.decode(materialize(loaded), tuple(full))
        if decoded.dtype != destination.dtype and destination.dtype == torch.int8:
            decoded = decoded.to(torch.int8)
        loaded = decoded
    load_shard(destination, loaded, spec.tp_dim, tp_rank, tp_size)


def load_quant_part(
    destination: torch.Tensor,
    loaded: LoadedWeight,
    spec: QuantParam,
    offset: int,
    size: int,
    tp_rank: int,
    tp_size: int,
) -> None:
    """Decode one part of a fused column layer (gate of gate_up, q of qkv) into rows [offset, offset
    + size) of this rank's parameter: the part's rows of a weight, scale or zero point, or the shared
    input scale whole."""
    if spec.shared:
        load_quant_tensor(destination, loaded, spec, tp_rank, tp_size)
        return
    rows = spec.rows_per_entry
    if offset % rows or size % rows:
        raise WeightLoadError(f"a part of {size} rows at {offset} does not hold whole {rows}-row blocks")
    load_quant_tensor(destination.narrow(0, offset // rows, size // rows), loaded, spec, tp_rank, tp_size)


def checkpoint_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name as our parameters know it: weight_packed -> weight; None for the
    compressed-tensors tensors whose data nothing reads (weight_shape: the layer knows its shape)."""
    module, _, tensor = name.rpartition(".")
    if tensor in CHECKPOINT_IGNORED:
        return None
    return f"{module}.{CHECKPOINT_ALIASES.get(tensor, tensor)}"


def fused_parts(module_name: str, packed_modules_mapping: Mapping[str, tuple[str, object]]) -> list[str]:
    """The checkpoint module names one of our modules stands for: q_proj, k_proj, v_proj for qkv_proj."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = [ckpt for ckpt, (fused, _) in packed_modules_mapping.items() if fused == leaf]
    if not parts:
        return [module_name]
    return [f"{prefix}.{part}" if prefix else part for part in parts]


class QuantizableLinear:
    """What a layer of weight [N, K] (cut along `tp_dim`) needs to take a quantized scheme: mixed
    into module/linear.py's LinearBase and module/embedding.py's embedding and LM head. A layer whose
    dense weight another op reads (`reads_dense_weight`: MLA's kv_b_proj) is dequantized at load
    whatever its kind."""

    reads_dense_weight = False
    weight: nn.Parameter
    # set_scheme's (a plain embedding's scheme is None; a plain linear layer's is never set)
    scheme: LinearScheme | None
    linear_method: LinearMethod | None  # None: an embedding, which looks its rows up
    compute_dtype: torch.dtype
    quantize_at_load: bool
    tp_dim: int
    tp_rank: int
    tp_size: int
    weight_loader: WeightLoader

    def set_scheme(
        self,
        scheme: LinearScheme,
        method: LinearMethod | None,
        compute_dtype: torch.dtype,
        at_load: bool,
        tied_to: QuantizableLinear | None = None,
    ) -> None:
        """Run this layer by `method` (None: an embedding, which looks rows up) under `scheme`: its
        parameters become the checkpoint's quantized tensors, or (`at_load`) the float weight stays
        and is rounded after loading. A layer `tied_to` another (an LM head tied to the embedding)
        shares that layer's quantized parameters, as it shared its weight."""
        self.scheme = scheme
        self.linear_method = method
        self.compute_dtype = compute_dtype
        self.quantize_at_load = at_load
        if at_load:
            return
        rows, cols = self.weight.shape
        for name, (param, spec) in quant_parameters(scheme, rows, cols, self.tp_dim).items():
            if tied_to is not None:
                setattr(self, name, getattr(tied_to, name))  # loaded once, by its owner's loader
                continue
            set_quant_param(param, spec)
            set_weight_loader(param, self.weight_loader)
            setattr(self, name, param)
