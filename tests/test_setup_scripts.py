"""Specification of scripts/setup.sh and test.sh, run against a stand-in interpreter that records calls.

The stand-in is a real (empty) venv's python behind a wrapper that only pretends to import torch
(unless STAND_IN_NO_TORCH=1) and to run pip, the default-model CLI and pytest, so these tests
install and download nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "{log}"
case "$1 $2" in
    "-c import torch") exit "${{STAND_IN_NO_TORCH:-0}}" ;;
    "-m pip" | "-m executor.model_loader.default_model") exit 0 ;;
    "-m pytest") shift 2; printf '%s\\n' "$@" > "{pytest_args}"; exit 0 ;;
esac
exec "{venv}/bin/python" "$@"
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "python"
    python.write_text(
        STAND_IN.format(log=tmp_path / "calls.log", pytest_args=tmp_path / "pytest_args", venv=tmp_path / "venv")
    )
    python.chmod(0o755)
    return python


def run_bash(script: str, python: Path, **env: str) -> subprocess.CompletedProcess[str]:
    inherited = {key: value for key, value in os.environ.items() if key not in ("RUN_SLOW", "HF_HUB_OFFLINE")}
    environment = inherited | {"PYTHON": str(python)} | env
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, check=True)


def calls(python: Path) -> list[str]:
    return (python.parent / "calls.log").read_text().splitlines()


def pytest_args(python: Path) -> list[str]:
    return (python.parent / "pytest_args").read_text().splitlines()


@pytest.mark.parametrize("script", ["scripts/setup.sh", "test.sh", ".ci/run"])
def test_scripts_are_executable_and_parse(script: str) -> None:
    assert os.access(ROOT / script, os.X_OK)
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def test_setup_installs_the_package_editable_and_fetches_the_default_model(stand_in: Path) -> None:
    run_bash("source scripts/setup.sh", stand_in)
    assert f"-m pip install -q -e {ROOT}[test]" in calls(stand_in)
    assert "-m executor.model_loader.default_model" in calls(stand_in)


@pytest.mark.parametrize("has_torch", [True, False])
def test_setup_installs_torch_only_when_it_cannot_be_imported(stand_in: Path, has_torch: bool) -> None:
    run_bash("source scripts/setup.sh", stand_in, STAND_IN_NO_TORCH="0" if has_torch else "1")
    assert ("-m pip install -q torch==2.13.0" in calls(stand_in)) is not has_torch


def test_setup_is_quiet_and_skips_pip_the_second_time(stand_in: Path) -> None:
    run_bash("source scripts/setup.sh", stand_in)
    (stand_in.parent / "calls.log").unlink()
    second = run_bash("source scripts/setup.sh", stand_in)
    assert second.stdout == second.stderr == ""
    assert not [call for call in calls(stand_in) if call.startswith("-m pip")]


def test_setup_exports_python_and_hub_offline_to_the_caller(stand_in: Path) -> None:
    result = run_bash("source scripts/setup.sh && bash -c 'echo \"$PYTHON $HF_HUB_OFFLINE\"'", stand_in)
    assert result.stdout.split() == [str(stand_in), "1"]


def test_test_sh_skips_slow_tests_by_default(stand_in: Path) -> None:
    run_bash("bash test.sh", stand_in)
    assert pytest_args(stand_in) == ["-q", "-m", "not slow"]


def test_test_sh_runs_slow_tests_with_run_slow(stand_in: Path) -> None:
    run_bash("bash test.sh", stand_in, RUN_SLOW="1")
    assert pytest_args(stand_in) == ["-q"]


def test_test_sh_passes_its_arguments_to_pytest(stand_in: Path) -> None:
    run_bash('bash test.sh -m "slow or not slow" -x', stand_in)
    assert pytest_args(stand_in) == ["-q", "-m", "slow or not slow", "-x"]
