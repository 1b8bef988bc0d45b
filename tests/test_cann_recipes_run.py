"""A cann-recipes YAML of a family built here runs end to end on CPU, and cann-recipes' entry
(executor/scripts/infer.sh --model <dir> --yaml <file>) finds models/<dir>/config/<file>."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from executor.offline import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]
CANN_R1 = ROOT / "tests" / "data" / "cann_recipes" / "deepseek_r1.yaml"


def test_a_cann_recipes_deepseek_r1_yaml_runs_with_random_weights_and_its_layer_override(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)  # its model_path is relative, as cann-recipes' are to where one runs
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    status = cli.main(
        [
            "--yaml",
            str(CANN_R1),
            "--set",
            f"model_config.output_path={out}",
            "--set",
            "model_config.device=cpu",
            "--set",
            "scheduler_config.batch_size_meaning=num_requests",  # cann-recipes' batch_size: 4 requests
            "--set",
            "data_config.apply_chat_template=false",  # the tiny tokenizer has no chat template
        ]
    )
    assert status == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 6 for line in lines)
    assert max(line["prompt_tokens"] for line in lines) == 24  # input_truncated_len
    log = caplog.text
    assert "custom_params.num_hidden_layers: 2 of the config's 4 layers" in log
    assert "model_config.custom_params.enable_mla_prolog is not applicable here" in log
    cann_log = (out / "steps.log").read_text()  # its worded lines: the run folder's, not the console's
    assert "[Main] Inference time (prefill): " in cann_log and "[Main] Inference time (decode): " in cann_log
    assert "deepseek_r1 main and mtp model average inference time cost is " in cann_log
    assert "deepseek_r1 model average equivalent latency of MTP1 is " in cann_log


def run_entry(*args: str) -> subprocess.CompletedProcess[str]:
    command = ["bash", str(ROOT / "executor" / "scripts" / "infer.sh"), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_the_cann_entry_names_the_model_folders_when_the_folder_is_unknown():
    result = run_entry("--model", "no_such_model", "--yaml", "run.yaml")
    assert result.returncode == 2
    assert "no folder models/no_such_model" in result.stderr and "deepseek_v3" in result.stderr


def test_the_cann_entry_looks_for_the_yaml_in_the_folders_config_and_lists_it():
    result = run_entry("--model", "deepseek_v3", "--yaml", "no_such.yaml")
    assert result.returncode == 2
    assert "no no_such.yaml in models/deepseek_v3/config/" in result.stderr and "tiny_random.yaml" in result.stderr


def test_the_cann_entry_refuses_an_unknown_mode_and_missing_arguments():
    """--mode online starts the server (tests/test_online_entry.py); other modes are refused."""
    assert "offline or online" in run_entry("--model", "deepseek_v3", "--mode", "batch").stderr
    assert run_entry("--model", "deepseek_v3").returncode == 2
