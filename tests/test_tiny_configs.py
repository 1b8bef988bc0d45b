"""Every family's shipped tiny random config (`models/<f>/config/tiny_random.yaml`: random weights,
`with_ckpt: false`, the byte-level tokenizer, the shipped prompts) runs end to end, and decodes in
ge_graph the tokens it decodes eagerly: the same prompts, once eager and once through an
inductor-compiled decode bucket that the shrinking batch is padded to (slow: each family compiles).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.core.config import load_config
from executor.offline.__main__ import load_records, resolve_model_path
from executor.offline.__main__ import main as offline_main
from executor.offline.offline_inference import OfflineInference

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIGS = sorted(ROOT.glob("models/*/config/tiny_random.yaml"))
# Batch 4 with one bucket of 4 (one compile per family), requests finishing at different steps: steps of
# 3, 2 and 1 rows are padded to it, their padded rows writing the null block (and state slot).
SETTINGS = [
    "data_config.num_prompts=4",
    "scheduler_config.batch_size=4",
    "scheduler_config.graph_buckets=[4]",
    "scheduler_config.max_new_tokens=10",
    "scheduler_config.max_model_len=1024",
    "model_config.device=cpu",
]


def greedy_tokens(yaml: Path, *overrides: str) -> tuple[list[list[int]], dict]:
    config = load_config(yaml, [*SETTINGS, *overrides])
    records = load_records(config)
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 4 + 2 * index
    result = OfflineInference(config, str(resolve_model_path(config))).generate(records)
    return [request.output_token_ids for request in result.requests], result.summary


FAMILY_IDS = [path.parts[-3] for path in TINY_CONFIGS]


@pytest.mark.parametrize("yaml", TINY_CONFIGS, ids=FAMILY_IDS)
def test_the_tiny_random_yaml_runs_end_to_end(yaml, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    output_dir = tmp_path / "run"
    overrides = [
        "data_config.num_prompts=3",
        "scheduler_config.max_new_tokens=4",
        f"model_config.output_path={output_dir}",
    ]
    assert offline_main(["--yaml", str(yaml), *(arg for o in overrides for arg in ("--set", o))]) == 0
    assert len((output_dir / "outputs.jsonl").read_text().splitlines()) == 3


# DeepSeek-V4 and GLM-5 compile longest; their own parity files trace a decode step as one graph
LONG_GRAPH_FAMILIES = {"deepseek_v4", "glm_5"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "yaml",
    [
        pytest.param(path, id=family, marks=[pytest.mark.long] if family in LONG_GRAPH_FAMILIES else [])
        for path, family in zip(TINY_CONFIGS, FAMILY_IDS, strict=True)
    ],
)
def test_ge_graph_decode_equals_eager(yaml, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' model_path is relative to the repository
    eager, _ = greedy_tokens(yaml)
    graph, summary = greedy_tokens(yaml, "model_config.exe_mode=ge_graph")
    assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0, "no decode step ran in a graph"
    assert graph == eager
