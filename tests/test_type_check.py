"""The type checker over ops/ and module/ (pyproject's [tool.mypy]): every backend's form of an op and
every layer's call of it hold to the op's signature (ops/signatures.py, ops/attention/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_passes_over_ops_and_module():
    pytest.importorskip("mypy", reason="mypy is in the test extras (pip install -e .[test])")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
