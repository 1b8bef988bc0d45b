"""Convert a GGUF file into a Hugging Face model folder: fp32 safetensors weights (dequantized), or
its Q4_1 / Q8_0 blocks kept as our quantized layers' tensors.

transformers reads the GGUF's config and tokenizer (and, for the fp32 folder, dequantizes every
tensor); the folder it writes then loads in about a second, where the GGUF takes tens of seconds, and
every loader here reads it like any other checkpoint. The folder appears only once it is complete.

    python -m executor.model_loader.gguf_import FILE.gguf OUTPUT_DIR [--blocks]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for a model hub

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

from executor.model_loader.gguf_blocks import read_gguf_tensors
from executor.types_.quant_scheme import GGUF_FORMAT

GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes


class GGUFFileError(ValueError):
    """A file that is not a whole GGUF: the message names it and what is wrong, in one line."""


def check_gguf_file(gguf_path: Path) -> None:
    """The file exists, starts with GGUF's magic, and its header and every tensor lie within it
    (gguf's reader maps them all, and fails on a file cut short)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    with open(gguf_path, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GGUFFileError(f"{gguf_path}: not a GGUF file (it starts with {magic!r}, a GGUF with {GGUF_MAGIC!r})")
    try:
        GGUFReader(str(gguf_path))
    except (ValueError, IndexError, KeyError, OverflowError) as exc:  # numpy's, on a header or tensor cut short
        reason = " ".join(str(exc).split())[:200]
        raise GGUFFileError(
            f"{gguf_path}: truncated or corrupt GGUF ({gguf_path.stat().st_size} bytes; its header or tensors "
            f"do not fit: {reason}); fetch the file again"
        ) from None


def convert_gguf(gguf_path: Path, output_dir: Path) -> Path:
    """Write config, fp32 weights, tokenizer (with chat template) and generation config to output_dir."""

    def write_weights(folder: Path) -> None:
        # dequantize=True yields plain dense tensors and drops the quantizer, which would otherwise
        # keep GGUF blocks on some devices and make save_pretrained refuse the model.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        model.save_pretrained(folder)

    return _write_folder(gguf_path, output_dir, write_weights)


def convert_gguf_blocks(gguf_path: Path, output_dir: Path) -> Path:
    """Like convert_gguf, but the Q4_1 and Q8_0 tensors stay in their blocks (executor/model_loader/
    gguf_blocks.py), named in config.json's quantization_config ({"quant_method": "gguf-blocks",
    "modules": {module: block type}}); the other tensors are fp32."""

    def write_weights(folder: Path) -> None:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        config.dtype = torch.float32  # what the unquantized tensors hold
        read = read_gguf_tensors(gguf_path, config)
        config.architectures = [read.architecture]
        config.quantization_config = {
            "quant_method": GGUF_FORMAT,
            "source": gguf_path.name,
            "modules": dict(sorted(read.block_types.items())),
        }
        save_file({name: tensor.contiguous() for name, tensor in read.tensors.items()}, folder / "model.safetensors")
        config.save_pretrained(folder)
        GenerationConfig.from_model_config(config).save_pretrained(folder)

    return _write_folder(gguf_path, output_dir, write_weights)


def _write_folder(gguf_path: Path, output_dir: Path, write_weights: Callable[[Path], None]) -> Path:
    """The tokenizer and what `write_weights` writes, in a hidden temporary folder beside output_dir
    that is renamed into place at the end, so an interrupted conversion never leaves a folder that looks done."""
    check_gguf_file(gguf_path)
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} already exists; remove it to convert again")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = Path(tempfile.mkdtemp(prefix=partial_prefix(output_dir), dir=output_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        write_weights(partial_dir)
        tokenizer.save_pretrained(partial_dir)
        partial_dir.chmod(0o755)  # mkdtemp makes it private; the finished folder should not be
        partial_dir.rename(output_dir)
    except BaseException:
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    return output_dir


def partial_prefix(output_dir: Path) -> str:
    """Name prefix of the temporary folders a conversion into output_dir works in."""
    return f".{output_dir.name}.partial-"


def main(argv: list[str] | None = None) -> int:
    """0 once the folder is written; 2, with one `error:` line, for a file that is missing or not a
    whole GGUF, or an output folder that exists already."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--blocks", action="store_true", help="keep Q4_1 / Q8_0 tensors in their blocks")
    args = parser.parse_args(argv)
    convert = convert_gguf_blocks if args.blocks else convert_gguf
    try:
        print(convert(args.gguf.expanduser(), args.output_dir.expanduser()))
    except (GGUFFileError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
