"""Write a compressed-tensors checkpoint from a model folder, rounding to nearest: what vLLM,
transformers and this harness read as a quantized model.

    python -m executor.offline.quantize_checkpoint MODEL_DIR OUTPUT_DIR --scheme w8a8 [--static] [--ignore lm_head]

transformers loads the model; compressed-tensors attaches the scheme (`apply_quantization_config`),
computes each layer's scales and zero points from its weights (`calculate_qparams`: round to
nearest, no calibration of the weights), compresses and writes the format and its config.json
`quantization_config`. `--static` gives the activations static per-tensor scales, observed
(max |x|) over calibration prompts (the model folder's tokenizer on dataset/default.jsonl's, or
`--calibration` token ids). The schemes are model_config.quantization's weight names
(executor/model_loader/quantization_config.py). The folder appears only once it is complete.

Routed experts: transformers 5 holds them as fused 3-D parameters, which the `Linear` target does
not reach, and saves them per expert (`mlp.experts.E.{gate,up,down}_proj.weight`, Linear modules in
the checkpoint's layout, which the same target names). Each is rounded to nearest here with the
same qparams and compressed by compressed-tensors' compressor of the group's format, under the
names it gives a Linear's tensors (weight_packed, weight_scale, ...); transformers dequantizes them
on load, vLLM and this harness run them quantized. Experts stacked in the checkpoint itself (not
per-expert modules) stay as they are; routers stay unquantized.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from executor.model_loader.quantization_config import preset_scheme
from executor.types_.quant_scheme import QuantArgs
from module.moe import EXPERT_TENSOR
from ops.quant_math import weight_groups

DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "dataset" / "default.jsonl"


def our_args(args: QuantizationArgs) -> QuantArgs:
    """The fields of compressed-tensors' args that weight_groups reads."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    block = tuple(args.block_structure) if args.block_structure else None
    return QuantArgs(args.num_bits, str(args.type), strategy, args.symmetric, args.group_size, block)


def set_weight_qparams(module: torch.nn.Module, args: QuantizationArgs) -> None:
    """Round-to-nearest scale and zero point of `module`'s weight, in the shapes compressed-tensors made."""
    scale, zero_point = calculate_qparams(*weight_groups(module.weight.data.float(), our_args(args)), args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        zero_point = zero_point.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
        module.weight_zero_point.data = zero_point


@torch.no_grad()
def calibrate_input_scales(model: torch.nn.Module, token_ids: Sequence[Sequence[int]]) -> None:
    """Static per-tensor input scales: max |x| seen over the calibration prompts, over the range's half."""
    observed: dict[str, float] = {}
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "input_scale")}

    def hook(name: str):
        def record(_module, inputs):
            observed[name] = max(observed.get(name, 0.0), inputs[0].abs().max().item())

        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in quantized.items()]
    try:
        for ids in token_ids:
            model(torch.tensor([list(ids)]))
    finally:
        for handle in handles:
            handle.remove()
    for name, module in quantized.items():
        args = module.quantization_scheme.input_activations
        scale, _ = calculate_qparams(torch.tensor([-observed[name]]), torch.tensor([observed[name]]), args)
        module.input_scale.data = scale.to(module.input_scale.dtype).reshape(module.input_scale.shape)


def quantize_expert_tensors(folder: Path, scheme: QuantizationScheme, static: bool) -> int:
    """Rewrite the saved checkpoint's routed expert weights compressed (see the module docstring);
    -> how many were. `--static` would need the experts' inputs calibrated, which is not built."""
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    renamed: dict[str, list[str]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        if not any(EXPERT_TENSOR.match(name) for name in tensors):
            continue
        if static:
            raise SystemExit("--static: calibrating routed experts' input scales is not built; use dynamic activations")
        out = {}
        for name, tensor in tensors.items():
            if EXPERT_TENSOR.match(name) is None:
                out[name] = tensor
                continue
            module = name.removesuffix(".weight")
            scale, zero_point = calculate_qparams(
                *weight_groups(tensor.float(), our_args(scheme.weights)), scheme.weights
            )
            state = {"weight": tensor, "weight_scale": scale.to(tensor.dtype)}
            if not scheme.weights.symmetric:
                state["weight_zero_point"] = zero_point.to(torch.int8)
            compressed = {f"{module}.{key}": value for key, value in compressor.compress(state, scheme).items()}
            out.update(compressed)
            renamed[name] = list(compressed)
        save_file(out, shard, metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    if renamed and index_path.exists():
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        for name, new_names in renamed.items():
            shard_name = weight_map.pop(name)
            weight_map.update(dict.fromkeys(new_names, shard_name))
        index_path.write_text(json.dumps(index, indent=2))
    return len(renamed)


def scheme_for(name: str, static: bool) -> QuantizationScheme:
    """compressed-tensors' scheme for one of model_config.quantization's weight names."""
    scheme = preset_scheme(name, "--scheme")
    if static:
        if scheme.input_activations is None:
            raise SystemExit(f"--static: {name} does not quantize activations")
        scheme.input_activations.dynamic = False
        scheme.input_activations.strategy = QuantizationStrategy.TENSOR
    return scheme


def quantized_model(
    model_dir: Path,
    scheme: str,
    *,
    static: bool = False,
    ignore: Sequence[str] = ("lm_head",),
    calibration: Sequence[Sequence[int]] | None = None,
) -> torch.nn.Module:
    """transformers' fp32 model of `model_dir` with compressed-tensors' scheme attached and every
    layer's scales and zero points set (not compressed yet: its forward fake-quantizes)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quant_scheme = scheme_for(scheme, static)
    quant_scheme.targets = ["Linear"]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": quant_scheme}, ignore=list(ignore)))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            set_weight_qparams(module, module.quantization_scheme.weights)
    if static:
        calibrate_input_scales(model, calibration or default_calibration(model_dir))
    return model


def quantize_checkpoint(
    model_dir: Path,
    output_dir: Path,
    scheme: str,
    *,
    static: bool = False,
    ignore: Sequence[str] = ("lm_head",),
    calibration: Sequence[Sequence[int]] | None = None,
    quantization_format: str | None = None,
) -> Path:
    """Write `model_dir` quantized by `scheme` to output_dir (see the module docstring), in
    `quantization_format` where given (naive-quantized, ...), else the one compressed-tensors infers."""
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} already exists; remove it or choose another folder")
    model = quantized_model(model_dir, scheme, static=static, ignore=ignore, calibration=calibration)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=quantization_format)
    compressor.compress_model(model)
    group = compressor.quantization_config.config_groups["group_0"]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        model.save_pretrained(partial)
        quantize_expert_tensors(partial, group, static)
        compressor.update_config(str(partial))
        for extra in model_dir.iterdir():  # tokenizer, chat template, generation config
            if extra.is_file() and not (partial / extra.name).exists() and not extra.name.endswith(".safetensors"):
                shutil.copy2(extra, partial / extra.name)
        partial.chmod(0o755)
        partial.rename(output_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return output_dir


def default_calibration(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = DEFAULT_CALIBRATION.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    return [tokenizer(prompt)["input_ids"][:256] for prompt in prompts]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument(
        "--scheme", required=True, help="w8a8, w8a16, w4a16[_gN], w4a16_asym, w4a8, fp8, fp8_block, ..."
    )
    parser.add_argument("--static", action="store_true", help="static per-tensor activation scales (calibrated)")
    parser.add_argument("--ignore", nargs="*", default=["lm_head"], help="modules left unquantized (names or re:)")
    parser.add_argument("--format", help="compressed-tensors format (naive-quantized, ...); default: the one it infers")
    args = parser.parse_args(argv)
    path = quantize_checkpoint(
        args.model_dir,
        args.output_dir,
        args.scheme,
        static=args.static,
        ignore=args.ignore,
        quantization_format=args.format,
    )
    print(path)


if __name__ == "__main__":
    main()
