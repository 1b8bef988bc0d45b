"""Convert a GGUF file into an ordinary Hugging Face model folder with fp32 safetensors weights.

transformers reads the GGUF (dequantising every tensor, rebuilding config and tokenizer); the
folder it writes then loads in about a second, where the GGUF takes tens of seconds, and every
loader here reads it like any other checkpoint. The folder appears only once it is complete.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for a model hub

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def convert_gguf(gguf_path: Path, output_dir: Path) -> Path:
    """Write config, fp32 weights, tokenizer (with chat template) and generation config to output_dir.

    The work happens in a hidden temporary folder beside output_dir that is renamed into place at
    the end, so an interrupted conversion never leaves a folder that looks done.
    """
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} already exists; remove it to convert again")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = Path(tempfile.mkdtemp(prefix=partial_prefix(output_dir), dir=output_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # dequantize=True yields plain dense tensors and drops the quantizer, which would otherwise
        # keep GGUF blocks on some devices and make save_pretrained refuse the model.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        model.save_pretrained(partial_dir)
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
