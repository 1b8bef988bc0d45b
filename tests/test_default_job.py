"""The shipped default job runs end to end on the real model (a few prompts, a few tokens)."""

import json
from pathlib import Path

from executor.offline import __main__ as cli

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "models" / "llama" / "config" / "smollm2_135m.yaml"


def test_default_yaml_generates_text_for_the_shipped_prompts(smollm2_dir, tmp_path, capsys):
    status = cli.main(
        [
            "--yaml",
            str(DEFAULT_YAML),
            "--set",
            "data_config.num_prompts=4",
            "--set",
            "scheduler_config.max_new_tokens=8",
            "--set",
            f"model_config.output_path={tmp_path}",
        ]
    )
    assert status == 0
    outputs = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == 4
    assert all(o["error"] is None and o["output_text"].strip() for o in outputs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == 4 and summary["failed_requests"] == 0 and summary["dtype"] == "float32"
    assert "=== run complete" in capsys.readouterr().out
