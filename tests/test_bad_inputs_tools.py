"""Hostile inputs to the command lines beside a run (tests/bad_inputs holds the run's own): each ends
with exit 2 and one `error:` line that names the file and what is wrong, with no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from executor.model_loader import gguf_import
from executor.offline import report
from executor.offline.run_folder import CONFIG_FILE, OUTPUTS_FILE, STEPS_FILE
from tests.test_model_loader import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    (line,) = stderr.splitlines()
    assert line.startswith("error: ")
    return line


def test_gguf_import_of_a_truncated_file_says_so_in_one_line(tiny_gguf_bytes, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf_bytes[: len(tiny_gguf_bytes) // 2])
    assert gguf_import.main([str(cut), str(tmp_path / "out")]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{cut}: truncated or corrupt GGUF ({len(tiny_gguf_bytes) // 2} bytes" in line
    assert not (tmp_path / "out").exists()


def test_gguf_import_of_a_file_cut_inside_its_header_says_so_in_one_line(tiny_gguf_bytes, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf_bytes[:10])
    assert gguf_import.main([str(cut), str(tmp_path / "out"), "--blocks"]) == 2
    assert f"{cut}: truncated or corrupt GGUF (10 bytes" in error_line(capsys.readouterr().err)


def test_gguf_import_of_a_file_with_the_wrong_magic_names_it(tiny_gguf_bytes, tmp_path, capsys):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + tiny_gguf_bytes[4:])
    assert gguf_import.main([str(other), str(tmp_path / "out")]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{other}: not a GGUF file (it starts with b'PK\\x03\\x04', a GGUF with b'GGUF')" in line


def test_gguf_import_of_a_missing_file_names_it(tmp_path, capsys):
    assert gguf_import.main([str(tmp_path / "absent.gguf"), str(tmp_path / "out")]) == 2
    assert f"GGUF file {tmp_path / 'absent.gguf'} does not exist" in error_line(capsys.readouterr().err)


def test_gguf_import_into_an_existing_folder_names_it(tiny_gguf_bytes, tmp_path, capsys):
    (tmp_path / "tiny.gguf").write_bytes(tiny_gguf_bytes)
    (tmp_path / "out").mkdir()
    assert gguf_import.main([str(tmp_path / "tiny.gguf"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'out'} already exists" in error_line(capsys.readouterr().err)


def run_folder(path: Path, prompts: dict[str, str], settings: dict[str, dict]) -> Path:
    """A run folder as a run leaves it: a step, a config.yaml, and one outputs line per request
    (the prompt token ids' hash standing for the prompts)."""
    path.mkdir()
    (path / STEPS_FILE).write_text(json.dumps({"step": 1, "step_time_ms": 2.0, "phase": "decode"}) + "\n")
    (path / CONFIG_FILE).write_text(yaml.safe_dump(settings))
    lines = [
        {"id": request_id, "prompt_token_ids_hash": prompt, "output_token_ids": [1, 2], "error": None}
        for request_id, prompt in prompts.items()
    ]
    (path / OUTPUTS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_compare_leaves_out_requests_of_other_prompts_and_names_the_settings_that_differ(tmp_path, capsys):
    before = run_folder(tmp_path / "a", {"a": "h1", "b": "h2"}, {"data_config": {"temperature": 0.0}})
    after = run_folder(tmp_path / "b", {"a": "h1", "b": "h3"}, {"data_config": {"temperature": 0.7}})
    assert report.main(["--compare", str(before), str(after)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[2] == "settings that differ: data_config.temperature was 0.0, now 0.7"
    (accuracy,) = [line for line in printed if line.startswith("accuracy")]
    assert accuracy.endswith("1 of 1 requests give identical tokens; 1 left out: their prompt token ids differ (b)")


def test_compare_of_runs_with_no_prompt_in_common_is_refused_in_one_line(tmp_path, capsys):
    settings = {"model_config": {"model_path": "/m"}}
    before = run_folder(tmp_path / "a", {"a": "h1", "b": "h2"}, settings)
    after = run_folder(tmp_path / "b", {"a": "h3", "b": "h4"}, settings)
    assert report.main(["--compare", str(before), str(after)]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{before} and {after} share no request with the same prompt token ids" in line
    assert "2 ids in both, 2 of them with other prompts" in line
