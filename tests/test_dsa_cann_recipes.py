"""cann-recipes' YAML files of the DSA folders (deepseek_v3_2_exp, glm_5 and the flattened glm_5_2, our
own files in tests/data/) find their model folder here and run end to end on CPU: the tiny random
model in place of the checkpoint, one process, MTP speculative decoding where the file asks for it
(next_n), and the settings that need NPUs (world and parallel sizes, context parallel, ge_graph,
offload) set back to one process's: on the command line, or, for the flattened file, whose keys
--set does not reach, in a copy of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from executor.core.config.model_registry import model_folder
from executor.offline import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"

# file -> the model folder its model_name finds
FILES = {
    DATA / "cann_recipes" / "deepseek_v3_2_exp.yaml": "deepseek_v3_2",
    DATA / "cann_recipes" / "glm_5.yaml": "glm_5",
    DATA / "cann_recipes_flat" / "glm_5_2.yaml": "glm_5",
}
# What one CPU process needs in place of the files' NPU settings, by sectioned name.
ONE_PROCESS = [
    "parallel_config.world_size=1",
    "parallel_config.cp_size=1",
    "parallel_config.o_proj_tp_size=1",
    "parallel_config.dense_tp_size=1",
    "parallel_config.embed_tp_size=1",
    "parallel_config.lmhead_tp_size=1",
    "model_config.exe_mode=eager",
    "data_config.dataset=default",
    "data_config.input_truncated_len=24",
    "scheduler_config.batch_size=4",
    "scheduler_config.max_new_tokens=6",
    "scheduler_config.max_prefill_tokens=1024",
    "scheduler_config.batch_size_meaning=num_requests",
]


# The same for the flattened file, whose keys --set does not reach: written into a copy of it.
FLAT_ONE_PROCESS = {
    "": {"world_size": 1, "exe_mode": "eager"},
    "model_config": {"enable_offload": False, "shared_indexer_offload": False, "perfect_eplb": False},
    "data_config": {"input_max_len": 24, "batch_size": 4, "max_new_tokens": 6},
    "parallel_config": {"cp_size": 1, "oproj_tp_size": 1, "dense_tp_size": 1, "embed_tp_size": 1, "lmhead_tp_size": 1},
}


def one_process_copy(path: Path, tmp_path: Path) -> Path:
    """The flattened file with FLAT_ONE_PROCESS's values, every other key as it is."""
    raw = yaml.safe_load(path.read_text())
    for section, values in FLAT_ONE_PROCESS.items():
        (raw[section] if section else raw).update(values)
    copy = tmp_path / path.name
    copy.write_text(yaml.safe_dump(raw))
    return copy


@pytest.mark.parametrize("path", list(FILES), ids=lambda p: p.stem)
def test_a_dsa_cann_recipes_yaml_runs_on_the_tiny_model(path, tmp_path, monkeypatch):
    folder = FILES[path]
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    flat = path.parent.name == "cann_recipes_flat"
    sets = [
        *([] if flat else ONE_PROCESS),
        f"model_config.model_path=models/{folder}/tiny_random",
        "model_config.with_ckpt=False",
        "model_config.next_n=1",  # the tiny model has one MTP module
        "data_config.num_prompts=4",
        "model_config.device=cpu",
        "data_config.apply_chat_template=false",
        f"model_config.output_path={out}",
    ]
    if flat:
        path = one_process_copy(path, tmp_path)
    assert cli.main(["--yaml", str(path), *(arg for s in sets for arg in ("--set", s))]) == 0
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["error"] is None and len(line["output_token_ids"]) == 6 for line in lines)
    assert model_folder(yaml.safe_load((out / "config.yaml").read_text())["model_config"]["model_name"]) == folder
