"""Every case in tests/bad_inputs/ (README there) ends with its expected exit status and words.

Exit 2 means the run could not start: the message is one `error:` line naming the key, file or
line, and (unless the case says otherwise) no model was loaded. Exit 3 and 4 mean requests failed
alone: each named request has an outputs.jsonl line whose error holds the words.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from executor.offline import __main__ as cli
from executor.platform import npu_runtime

CASES_DIR = Path(__file__).resolve().parent / "bad_inputs"
DEFAULT_DIR = CASES_DIR / "_default"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "case.yaml").is_file())
DEVICE_PRESENT = {"cuda": torch.cuda.is_available, "npu": npu_runtime.npu_is_available}


def test_the_corpus_has_at_least_40_cases():
    assert len(CASES) >= 40


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
    return target


def case_file(case_dir: Path, name: str) -> Path:
    return case_dir / name if (case_dir / name).is_file() else DEFAULT_DIR / name


def run_case(name: str, tmp_path: Path, tiny_llama_dir: Path, monkeypatch, capsys) -> tuple[int, str, Path]:
    """Run one case; returns (exit status, stderr, output folder)."""
    case_dir = CASES_DIR / name
    case = yaml.safe_load((case_dir / "case.yaml").read_text())
    device = case.get("skip_if")
    if device and DEVICE_PRESENT[device]():
        pytest.skip(f"needs a machine without {device}")
    edits = case.get("model_edits")
    model = edited_model(tiny_llama_dir, tmp_path / "model", edits) if edits else tiny_llama_dir
    out = tmp_path / "out"
    places = {"model": str(model), "dataset": str(case_file(case_dir, "prompts.jsonl")), "out": str(out)}
    places["tmp"] = str(tmp_path)
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
    """Put the case's paths in for {model}, {dataset}, {out} and {tmp}; bytes, so non-UTF-8 files stay as they are."""
    for key, value in places.items():
        template = template.replace(f"{{{key}}}".encode(), value.encode())
    return template


def _refuse_to_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was loaded although the input was bad")


@pytest.mark.parametrize("name", CASES)
def test_bad_input_case(name, tmp_path, tiny_llama_dir, monkeypatch, capsys):
    case = yaml.safe_load((CASES_DIR / name / "case.yaml").read_text())
    status, stderr, out = run_case(name, tmp_path, tiny_llama_dir, monkeypatch, capsys)
    assert status == case["exit"], stderr
    assert "Traceback" not in stderr
    if case.get("stderr"):
        (error_line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
        missing = [word for word in case["stderr"] if word not in error_line]
        assert not missing, f"{missing} not in {error_line!r}"
    if case.get("outputs"):
        lines = {line["id"]: line for line in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
        for request_id, words in case["outputs"].items():
            error = lines[request_id]["error"] or ""
            assert lines[request_id]["finish_reason"] == "error"
            assert [w for w in words if w not in error] == [], error
        served = [line for line in lines.values() if line["id"] not in case["outputs"]]
        assert all(line["error"] is None and line["output_token_ids"] for line in served)
