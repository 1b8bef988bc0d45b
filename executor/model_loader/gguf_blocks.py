"""A GGUF file's tensors under Hugging Face names, its Q4_1 and Q8_0 blocks kept as values and scales.

GGUF stores a quantized [N, K] tensor as N rows of K/32 blocks: Q4_1 blocks are an fp16 scale d, an
fp16 minimum m and 32 4-bit codes q (w = q * d + m), Q8_0 blocks an fp16 scale d and 32 int8 values
(w = q * d). Each becomes the tensors our quantized layers hold (module/quantized.py): `weight` [N, K]
(uint8 codes 0..15, or int8), `weight_scale` [N, K/32] fp32 and, for Q4_1, `weight_offset` [N, K/32]
fp32, so dequantizing them equals gguf's own dequantization bit for bit. Any other tensor type is
dequantized by gguf into fp32 and runs unquantized.

The names and the Q/K row permutation GGUF converters apply to attn_q / attn_k are transformers'
(modeling_gguf_pytorch_utils: its tensor name map and tensor processors). The permutation moves whole
rows, so it is applied to the rows of blocks before they are decoded; architectures whose processor
does more than that (splitting or reshaping tensors) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
    read_field,
)

from models import GGUF_ROW_PROCESSOR_NAMES

BLOCK_VALUES = 32
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes: byte j holds value j (low nibble) and j + 16
Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8 values
BLOCK_TYPES = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}


@dataclass(frozen=True, slots=True)
class GGUFTensors:
    """A GGUF's tensors under HF names (`<module>.weight`, `.weight_scale`, `.weight_offset`, ...),
    the block type of each module kept in blocks (`<module>` -> "q4_1" / "q8_0"), and the
    transformers class they are named for (config.json's `architectures`)."""

    tensors: dict[str, torch.Tensor]
    block_types: dict[str, str]
    architecture: str


def _block_fields(blocks: np.ndarray, block_bytes: int) -> torch.Tensor:
    """Rows of raw blocks [N, K/32 * block_bytes] -> [N, K/32, block_bytes] uint8."""
    rows = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True))
    return rows.reshape(rows.shape[0], -1, block_bytes)


def _fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def decode_q4_1(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows -> (codes [N, K] uint8 0..15, scale d [N, K/32] fp32, offset m [N, K/32] fp32)."""
    fields = _block_fields(blocks, Q4_1_BLOCK_BYTES)
    packed = fields[..., 4:]
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).reshape(fields.shape[0], -1)
    return codes, _fp16_field(fields, 0), _fp16_field(fields, 2)


def decode_q8_0(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (values [N, K] int8, scale d [N, K/32] fp32)."""
    fields = _block_fields(blocks, Q8_0_BLOCK_BYTES)
    values = fields[..., 2:].contiguous().view(torch.int8).reshape(fields.shape[0], -1)
    return values, _fp16_field(fields, 0)


def block_tensors(module: str, block_type: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """The quantized tensors of `module` from its rows of blocks."""
    if block_type == "q4_1":
        codes, scale, offset = decode_q4_1(blocks)
        return {f"{module}.weight": codes, f"{module}.weight_scale": scale, f"{module}.weight_offset": offset}
    values, scale = decode_q8_0(blocks)
    return {f"{module}.weight": values, f"{module}.weight_scale": scale}


def _row_processor(reader: GGUFReader, gguf_path: Path) -> TensorProcessor:
    architecture = read_field(reader, "general.architecture")[0]
    config = load_gguf_checkpoint(str(gguf_path))["config"]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    if type(processor).__name__ not in GGUF_ROW_PROCESSOR_NAMES:
        raise ValueError(
            f"{gguf_path}: architecture {architecture!r} reshapes its tensors on import "
            f"({type(processor).__name__}); only processors that reorder rows keep their blocks"
        )
    return processor


def hf_names(hf_config: Any, processor: TensorProcessor) -> tuple[dict[str, str], str]:
    """(GGUF tensor name -> HF name, the model's class name), from transformers' map over the model
    built on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return get_gguf_hf_weights_map(model, processor), type(model).__name__


def read_gguf_tensors(gguf_path: Path, hf_config: Any) -> GGUFTensors:
    """Every tensor of the GGUF that the model of `hf_config` (transformers' config read from the same
    file) has, under its HF name: Q4_1 / Q8_0 kept in blocks, the rest dequantized to fp32."""
    reader = GGUFReader(str(gguf_path))
    processor = _row_processor(reader, gguf_path)
    names, architecture = hf_names(hf_config, processor)
    tensors: dict[str, torch.Tensor] = {}
    block_types: dict[str, str] = {}
    for tensor in reader.tensors:
        block_type = BLOCK_TYPES.get(tensor.tensor_type)
        data = tensor.data if block_type else dequantize(tensor.data, tensor.tensor_type)
        processed = processor.process(weights=data, name=tensor.name)
        name = names.get(processed.name)
        if name is None:
            continue
        if block_type is None:
            tensors[name] = torch.from_numpy(np.array(processed.weights, dtype=np.float32, copy=True))
            continue
        module = name.removesuffix(".weight")
        tensors.update(block_tensors(module, block_type, processed.weights))
        block_types[module] = block_type
    return GGUFTensors(tensors, block_types, architecture)
