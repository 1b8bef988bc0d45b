"""Quantization schemes as plain data: what a layer's weights and inputs hold and how they were made.

Read from a checkpoint's compressed-tensors `quantization_config` or named by `model_config.quantization`
(executor/model_loader/quantization_config.py), and read by the layers (module/quantized.py) and the
linear methods (ops/quantized_linear.py). The fields mirror compressed-tensors' QuantizationArgs,
kept to what runs here, so a scheme is hashable and costs nothing to compare in the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

ONLINE = "online"  # a plan quantizes float weights at load (model_config.quantization)
INT = "int"
FLOAT = "float"
# strategies: how many scales a tensor has
TENSOR, CHANNEL, GROUP, BLOCK, TOKEN = "tensor", "channel", "group", "block", "token"

# Linear kinds: one LinearMethod per kind and backend (ops/backend.py's `linear`).
W8A8_INT8 = "w8a8_int8"  # int8 weights per channel, int8 activations per token or per tensor
WNA16 = "wna16"  # int4 / int8 weights per channel or group, activations in the model's dtype
W4A8 = "w4a8"  # int4 group weights, int8 activations per token
FP8 = "fp8"  # float8 e4m3 weights per tensor, channel or 128x128 block; fp8 or no activation quantization
MXFP4 = "mxfp4"  # fp4 e2m1 weights in 32-value groups with a power-of-two (e8m0) scale each
MXFP8 = "mxfp8"  # fp8 e4m3 weights in 32-value groups with an e8m0 scale each
QUANTIZED_KINDS = (W8A8_INT8, WNA16, W4A8, FP8, MXFP4, MXFP8)


@dataclass(frozen=True, slots=True)
class QuantArgs:
    """One tensor's quantization: compressed-tensors' QuantizationArgs, the fields that change the math."""

    num_bits: int
    type: str = INT
    strategy: str = CHANNEL
    symmetric: bool = True
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    dynamic: bool = False
    mx: bool = False  # scales are e8m0 exponents (uint8, 2 ** (s - 127)), as MXFP4/MXFP8 store them
    # values are unsigned codes 0..2^b-1 and each group adds a float offset: w = q * scale + offset
    # (GGUF's Q4_1), where compressed-tensors' asymmetric form subtracts an integer zero point
    offset: bool = False

    @property
    def q_range(self) -> tuple[float, float]:
        """The representable range: [-2^(b-1), 2^(b-1) - 1] for ints ([0, 2^b - 1] for offset codes),
        +-max for float8 / fp4."""
        if self.type == INT and self.offset:
            return 0, 2**self.num_bits - 1
        if self.type == INT:
            return -(2 ** (self.num_bits - 1)), 2 ** (self.num_bits - 1) - 1
        largest = {8: 448.0, 4: 6.0}[self.num_bits]
        return -largest, largest

    def describe(self) -> str:
        shape = f"{self.strategy} {self.group_size}" if self.strategy == GROUP else self.strategy
        if self.strategy == BLOCK and self.block_structure:
            shape = f"{self.block_structure[0]}x{self.block_structure[1]} blocks"
        kind = f"{'mx' if self.mx else ''}{self.type}{self.num_bits}"
        extras = ["float offsets"] if self.offset else [] if self.symmetric else ["zero points"]
        if self.dynamic:
            extras.append("dynamic")
        return f"{kind} per {shape}" + (f" ({', '.join(extras)})" if extras else "")


@dataclass(frozen=True, slots=True)
class LinearScheme:
    """A linear layer's scheme: its weights' args, its input activations' (None: not quantized)."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None

    @property
    def kind(self) -> str:
        """Which LinearMethod runs it (one of QUANTIZED_KINDS); ValueError for a combination none runs."""
        weights, inputs = self.weights, self.input_activations
        if weights.mx and weights.type == FLOAT and weights.num_bits in (4, 8):
            return MXFP4 if weights.num_bits == 4 else MXFP8
        if weights.type == FLOAT and weights.num_bits == 8 and (inputs is None or inputs.type == FLOAT):
            return FP8
        if weights.type == INT and weights.num_bits in (4, 8) and inputs is None:
            return WNA16
        if weights.type == INT and inputs is not None and inputs.type == INT and inputs.num_bits == 8:
            if weights.num_bits == 8 and weights.strategy in (CHANNEL, TENSOR):
                return W8A8_INT8
            if weights.num_bits == 4:
                return W4A8
        raise ValueError(f"no linear method runs {self.describe()}")

    def describe(self) -> str:
        inputs = self.input_activations.describe() if self.input_activations else "unquantized"
        return f"weights {self.weights.describe()}, activations {inputs}"


# GGUF block types kept as blocks (executor/model_loader/gguf_blocks.py): 32 values a block with an
# fp16 scale d, and for Q4_1 an fp16 minimum m: Q4_1 w = q * d + m (q in 0..15), Q8_0 w = q * d (q int8).
GGUF_FORMAT = "gguf-blocks"  # a quantization_config's quant_method for a folder of such blocks
GGUF_BLOCK_SCHEMES = MappingProxyType(
    {
        "q4_1": LinearScheme(QuantArgs(4, INT, GROUP, symmetric=False, group_size=32, offset=True)),
        "q8_0": LinearScheme(QuantArgs(8, INT, GROUP, symmetric=True, group_size=32)),
    }
)


@dataclass(frozen=True, slots=True)
class KVCacheScheme:
    """An int8 KV cache (C8): per-token-head dynamic scales, or static per-tensor / per-channel ones
    read from the checkpoint (`kv_cache_scheme`)."""

    strategy: str = TOKEN  # TOKEN: dynamic per token and head; TENSOR or CHANNEL: static
    num_bits: int = 8

    @property
    def dynamic(self) -> bool:
        return self.strategy == TOKEN

    def describe(self) -> str:
        how = "dynamic per token and head" if self.dynamic else f"static per {self.strategy}"
        return f"int{self.num_bits} ({how})"


@dataclass(frozen=True, slots=True)
class SchemeGroup:
    """One of quantization_config's config_groups: the modules its targets name get its scheme."""

    name: str
    targets: tuple[str, ...]
    scheme: LinearScheme


def _match_rank(name: str, class_name: str, target: str) -> int | None:
    """How specifically `target` names the module (compressed-tensors' order: 0 its exact name,
    1 a `re:` regex over its name, 2 its class), None when it does not."""
    if target == name:
        return 0
    if target.startswith("re:"):
        return 1 if re.match(target.removeprefix("re:"), name) else None
    return 2 if target == class_name else None


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """Which scheme each layer runs, and the KV cache's: a checkpoint's quantization_config (its
    tensors quantized already: `format` is its compressed-tensors format) or model_config.quantization
    (`format` "online": rounded to nearest at load)."""

    groups: tuple[SchemeGroup, ...] = ()
    ignore: tuple[str, ...] = ()
    kv_cache: KVCacheScheme | None = None
    format: str = ONLINE
    source: str = ""

    @property
    def at_load(self) -> bool:
        return self.format == ONLINE

    def scheme_for(self, name: str, class_name: str = "Linear") -> LinearScheme | None:
        """The scheme of checkpoint module `name` (of transformers class `class_name`), None if unquantized."""
        if any(_match_rank(name, class_name, target) is not None for target in self.ignore):
            return None
        best: tuple[int, LinearScheme] | None = None
        for group in self.groups:
            for target in group.targets:
                rank = _match_rank(name, class_name, target)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, group.scheme)
        return best[1] if best else None
