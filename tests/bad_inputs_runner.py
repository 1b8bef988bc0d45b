"""Running one case of tests/bad_inputs/ (see the README there) through the command line's main()."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from executor.offline import __main__ as cli
from executor.offline.quantize_checkpoint import quantize_checkpoint
from executor.platform import npu_runtime

CASES_DIR = Path(__file__).resolve().parent / "bad_inputs"
DEFAULT_DIR = CASES_DIR / "_default"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "case.yaml").is_file())
DEVICE_PRESENT = {"cuda": torch.cuda.is_available, "npu": npu_runtime.npu_is_available}


def load_case(name: str) -> dict[str, Any]:
    return yaml.safe_load((CASES_DIR / name / "case.yaml").read_text())


def edited_model(source: Path, target: Path, edits: dict[str, Any]) -> Path:
    shutil.copytree(source, target)
    for name in edits.get("delete", []):
        (target / name).unlink()
    for name, text in edits.get("write", {}).items():
        (target / name).write_text(text)
    for name, size in edits.get("truncate", {}).items():
        with open(target / name, "r+b") as file:
            file.truncate(size)
    for name, values in edits.get("json_set", {}).items():
        data = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps(data | values))
    if "tensors" in edits:
        edit_tensors(target / "model.safetensors", edits["tensors"])
    return target


def edit_tensors(path: Path, edits: dict[str, Any]) -> None:
    """`drop: [name]`, `dtype: {name: torch dtype name}`, `shape: {name: [new shape]}`, `values: {name:
    [[index], value]}` on one safetensors file."""
    tensors = load_file(path)
    for name, (index, value) in edits.get("values", {}).items():
        tensors[name][tuple(index)] = value
    for name in edits.get("drop", []):
        del tensors[name]
    for name, dtype in edits.get("dtype", {}).items():
        tensors[name] = tensors[name].to(getattr(torch, dtype))
    for name, shape in edits.get("shape", {}).items():
        tensors[name] = tensors[name].reshape(shape)
    save_file(tensors, path, metadata={"format": "pt"})


def case_file(case_dir: Path, name: str) -> Path:
    return case_dir / name if (case_dir / name).is_file() else DEFAULT_DIR / name


def run_case(name: str, tmp_path: Path, tiny_llama_dir: Path, monkeypatch, capsys) -> tuple[int, str, Path]:
    """Run one case; returns (exit status, stderr, output folder)."""
    case_dir = CASES_DIR / name
    case = load_case(name)
    device = case.get("skip_if")
    if device and DEVICE_PRESENT[device]():
        pytest.skip(f"needs a machine without {device}")
    source = tiny_llama_dir
    if "quantized" in case:
        source = quantize_checkpoint(tiny_llama_dir, tmp_path / "quantized", **case["quantized"])
    edits = case.get("model_edits")
    model = edited_model(source, tmp_path / "model", edits) if edits else source
    out = tmp_path / "out"
    places = {"model": str(model), "dataset": str(case_file(case_dir, "prompts.jsonl")), "out": str(out)}
    places |= {"tmp": str(tmp_path), "root": str(CASES_DIR.parents[1])}
    for relative, text in case.get("files", {}).items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_bytes(fill(text.encode(), places))
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_bytes(fill(case_file(case_dir, "run.yaml").read_bytes(), places))
    if not case.get("loads_model", case["exit"] != 2):
        monkeypatch.setattr(cli, "OfflineInference", _refuse_to_load)
    argv = ["--yaml", str(run_yaml)]
    for override in case.get("set", []):
        argv += ["--set", fill(override.encode(), places).decode()]
    status = cli.main(argv)
    return status, capsys.readouterr().err, out


def fill(template: bytes, places: dict[str, str]) -> bytes:
    """Put the case's paths in for {model}, {dataset}, {out}, {tmp} and {root}; bytes, so that
    non-UTF-8 files stay as they are."""
    for key, value in places.items():
        template = template.replace(f"{{{key}}}".encode(), value.encode())
    return template


def _refuse_to_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was loaded although the input was bad")
