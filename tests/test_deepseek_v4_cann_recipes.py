"""cann-recipes' DeepSeek-V4 configs: our file with their keys (tests/data/cann_recipes/runs/deepseek_v4.yaml)
validates, finds models/deepseek_v4 and runs end to end on CPU with random weights; every file of
cann-recipes' models/deepseek_v4/config validates, and what stops each from running here is said."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from executor.core.config import load_config
from executor.core.config.model_registry import model_folder
from executor.offline import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "cann_recipes" / "runs" / "deepseek_v4.yaml"
MIRROR = Path("/work/.mirror/hicann+cann-recipes-infer/repo")
FOLDER = "models/deepseek_v4/config"


def test_our_file_validates_and_finds_the_folder():
    config = load_config(TINY)
    assert model_folder(config.model_config.model_name) == "deepseek_v4"


def test_our_file_runs_end_to_end_with_random_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # its model_path is relative, as cann-recipes' are to where one runs
    out = tmp_path / "out"
    overrides = {
        "model_config.output_path": out,
        "model_config.device": "cpu",
        "scheduler_config.batch_size_meaning": "num_requests",  # cann-recipes' batch_size: 4 requests
        "data_config.apply_chat_template": "false",  # the tiny tokenizer has no chat template
    }
    assert cli.main(["--yaml", str(TINY), *(arg for k, v in overrides.items() for arg in ("--set", f"{k}={v}"))]) == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 6 for line in lines)


def mirror_files() -> list[str]:
    if not MIRROR.exists():
        return []
    listing = subprocess.run(
        ["git", "-C", str(MIRROR), "ls-tree", "-r", "--name-only", "HEAD", FOLDER], capture_output=True, text=True
    )
    return [name for name in listing.stdout.split() if name.endswith(".yaml")]


@pytest.mark.skipif(not MIRROR.exists(), reason="no cann-recipes-infer mirror on this machine")
@pytest.mark.parametrize("name", mirror_files() or ["none"])
def test_every_cann_recipes_deepseek_v4_file_validates(name, tmp_path):
    """Besides its checkpoint (DeepSeek-V4-Flash / -Pro, FP8 or quantized, hundreds of GB) and its
    world_size of 16 to 128 NPUs, what keeps a file from running here is found later: the graph modes
    and MTP above one process (preflight), and for deepseek_v4_flash_rank_128_128ep_128cp_w8a8.yaml
    context parallel over V4's compressed KV caches (refused when the model is built, before its
    weights: tests/test_context_parallel.py)."""
    path = tmp_path / Path(name).name
    shown = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{name}"], capture_output=True, text=True)
    path.write_text(shown.stdout)
    assert load_config(path).model_config.model_name == "deepseek_v4"
