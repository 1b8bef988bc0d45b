"""Check, before any weight is read, that a quantized checkpoint holds what its scheme needs.

From the safetensors headers alone (names, shapes, dtypes): for every checkpoint module of every
layer the plan quantizes, its values tensor in the format's dtype, its scale in the scheme's shape,
its zero point where the scheme is asymmetric (a float offset where it adds one) and its input scale
where the activations are static;
and no quantization tensor for a module the plan leaves unquantized. Each fault is one line naming
the scheme, the layer and the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

from executor.types_.quant_scheme import BLOCK, CHANNEL, FLOAT, GROUP, INT, TENSOR, LinearScheme, QuantizationPlan
from module.quantization_pass import QuantizedLayer
from module.quantized import QUANT_TENSORS, QuantizationError

TensorInfo = tuple[tuple[int, ...], str]  # (shape, safetensors dtype name)
FLOAT_DTYPES = ("F32", "F16", "BF16")
INT_DTYPES = ("I8", "I32", "I64", "I16", "U8")


def _values_tensor(module: str, scheme: LinearScheme, header: Mapping[str, TensorInfo]) -> tuple[str, int, int]:
    """(name, rows, columns) of the module's values tensor, its dtype checked against the scheme."""
    weights = scheme.weights
    for suffix in ("weight_packed", "weight"):
        name = f"{module}.{suffix}"
        if name in header:
            break
    else:
        raise QuantizationError(f"no {module}.weight or {module}.weight_packed")
    shape, dtype = header[name]
    if len(shape) != 2:
        raise QuantizationError(f"{name} has shape {list(shape)}, not [out, in]")
    rows, columns = shape
    if dtype == "I32":  # pack-quantized: 32 / bits values a word
        return name, rows, columns * (32 // weights.num_bits)
    if dtype == "U8" and weights.type == FLOAT and weights.num_bits == 4:  # mxfp4: two values a byte
        return name, rows, columns * 2
    expected = {INT: ("I8", *FLOAT_DTYPES), FLOAT: ("F8_E4M3",)}[weights.type]
    if weights.offset:
        expected = ("U8",)  # unsigned codes 0..2^b-1
    if dtype not in expected:
        raise QuantizationError(f"{name} is {dtype}, not {' or '.join(expected)}")
    return name, rows, columns


def _expected_scale_shapes(scheme: LinearScheme, rows: int, columns: int) -> list[tuple[int, ...]]:
    weights = scheme.weights
    if weights.strategy == TENSOR:
        return [(1,), (), (1, 1)]
    if weights.strategy == CHANNEL:
        return [(rows, 1), (rows,)]
    if weights.strategy == GROUP:
        return [(rows, -(-columns // weights.group_size))]
    if weights.strategy == BLOCK:
        block_rows, block_columns = weights.block_structure
        return [(-(-rows // block_rows), -(-columns // block_columns))]
    return []


def _check_module(module: str, scheme: LinearScheme, header: Mapping[str, TensorInfo]) -> None:
    _, rows, columns = _values_tensor(module, scheme, header)
    scale = f"{module}.weight_scale"
    if scale not in header:
        raise QuantizationError(f"{scale} is missing")
    shape, dtype = header[scale]
    scale_dtypes = ("U8",) if scheme.weights.mx else FLOAT_DTYPES
    if dtype not in scale_dtypes:
        raise QuantizationError(f"{scale} is {dtype}, not {' or '.join(scale_dtypes)}")
    expected = _expected_scale_shapes(scheme, rows, columns)
    if tuple(shape) not in expected:
        raise QuantizationError(f"{scale} has shape {list(shape)}, expected {list(expected[0])}")
    zero_point = f"{module}.weight_zero_point"
    offset = f"{module}.weight_offset"
    if scheme.weights.offset:
        if offset not in header:
            raise QuantizationError(f"{offset} is missing (the weights have float offsets)")
        if header[offset] != (tuple(shape), "F32"):
            raise QuantizationError(f"{offset} is {header[offset][1]} {list(header[offset][0])}, not F32 {list(shape)}")
    elif not scheme.weights.symmetric:
        if zero_point not in header:
            raise QuantizationError(f"{zero_point} is missing (the weights have zero points)")
        if header[zero_point][1] not in INT_DTYPES + FLOAT_DTYPES:
            raise QuantizationError(f"{zero_point} is {header[zero_point][1]}, not an integer")
    inputs = scheme.input_activations
    if inputs is not None and not inputs.dynamic:
        input_scale = f"{module}.input_scale"
        if input_scale not in header:
            raise QuantizationError(f"{input_scale} is missing (the activations have a static scale)")
        if len(header[input_scale][0]) > 1 or (header[input_scale][0] and header[input_scale][0][0] != 1):
            raise QuantizationError(f"{input_scale} has shape {list(header[input_scale][0])}, expected [1]")


def check_quantized_tensors(
    layers: list[QuantizedLayer], plan: QuantizationPlan, header: Mapping[str, TensorInfo]
) -> None:
    """Raise QuantizationError at the first fault (see the module docstring)."""
    quantized_modules = set()
    for layer in layers:
        for module in layer.checkpoint_names:
            quantized_modules.add(module)
            try:
                _check_module(module, layer.scheme, header)
            except QuantizationError as error:
                raise QuantizationError(f"{plan.source}: layer {module} ({layer.scheme.describe()}): {error}") from None
    for name in header:
        module, _, tensor = name.rpartition(".")
        if tensor in (*QUANT_TENSORS, "weight_packed") and module not in quantized_modules:
            raise QuantizationError(
                f"{plan.source}: tensor {name} quantizes {module}, which the plan leaves unquantized "
                "(its targets or ignore list do not match the checkpoint)"
            )
