"""Hostile inputs to the command lines beside a run (tests/bad_inputs holds the run's own): each ends
with exit 2 and one `error:` line that names the file and what is wrong, with no traceback."""

from __future__ import annotations

import pytest

from executor.model_loader import gguf_import
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
