"""cann-recipes' Gemma 4 config (models/gemma_4/config/gemma4_rank_8_8ep_decode.yaml there) as a file
of ours with the same keys: it validates with no unknown key, names the gemma_4 folder, and runs
end to end on one CPU process with the tiny random model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from executor.core.config import load_config
from executor.core.config.model_registry import model_folder
from executor.offline import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]
CANN_GEMMA4 = ROOT / "tests" / "data" / "cann_recipes" / "runs" / "gemma_4.yaml"
# Every key of cann-recipes' gemma4_rank_8_8ep_decode.yaml, by section.
CANN_KEYS = {
    "model_config": {
        "model_name",
        "model_path",
        "exe_mode",
        "with_ckpt",
        "enable_profiler",
        "enable_weight_nz",
        "enable_cache_compile",
        "enable_static_kernel",
    },
    "data_config": {"dataset", "input_truncated_len"},
    "parallel_config": {
        "world_size",
        "attn_tp_size",
        "moe_tp_size",
        "embed_tp_size",
        "lmhead_tp_size",
        "dense_tp_size",
    },
    "scheduler_config": {"max_new_tokens", "batch_size"},
}


def test_the_file_sets_cann_recipes_keys_and_validates():
    raw = yaml.safe_load(CANN_GEMMA4.read_text())
    assert {section: set(keys) for section, keys in raw.items()} == CANN_KEYS
    config = load_config(CANN_GEMMA4)
    assert model_folder(config.model_config.model_name) == "gemma_4"


def test_the_cann_recipes_gemma4_yaml_runs_with_random_weights(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)  # its model_path is relative, as cann-recipes' are to where one runs
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    overrides = [
        f"model_config.output_path={out}",
        "model_config.device=cpu",
        "scheduler_config.batch_size_meaning=num_requests",  # cann-recipes' batch_size: 4 requests
        "data_config.apply_chat_template=false",  # the tiny tokenizer has no chat template
    ]
    assert cli.main(["--yaml", str(CANN_GEMMA4), *(arg for o in overrides for arg in ("--set", o))]) == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 6 for line in lines)
    assert max(line["prompt_tokens"] for line in lines) == 32  # input_truncated_len
    assert "model_config.enable_weight_nz is not applicable here" in caplog.text
