"""The real default model in each graph mode: greedy output equal to eager's on the shipped prompts.

Slow (each bucket of the real model takes one to two minutes to compile on two cores), so marked
slow and run in CI, with one bucket per mode (several buckets, and which steps each serves, are
tests/test_graph_modes.py's, on the tiny model); the graphs go to the default compile cache.
"""

from __future__ import annotations

import pytest

from executor.offline.dataset import DATASET_DIR, load_prompts
from tests.engine_harness import make_inference
from tests.test_graph_modes import CACHED_ORIGIN

pytestmark = pytest.mark.slow

SETTINGS = {"batch_size": 6, "graph_buckets": [4], "max_model_len": 1024, "num_blocks": 160}
NUM_PROMPTS = 7  # 7 requests at batch 6: decode steps of 6, 5 (no bucket), then 4 to 1 rows (padded to bucket 4)


def greedy(smollm2_dir, records, **model_config) -> tuple[list[list[int]], dict]:
    inference = make_inference(smollm2_dir, model_config=model_config, max_new_tokens=24, **SETTINGS)
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 6 + 3 * index  # finish at different steps
    result = inference.generate(records)
    return [r.output_token_ids for r in result.requests], result.summary


@pytest.fixture(scope="module")
def records():
    return load_prompts(DATASET_DIR / "default.jsonl")[:NUM_PROMPTS]


@pytest.mark.parametrize("exe_mode", ["ge_graph", pytest.param("npugraph_ex", marks=pytest.mark.long)])
def test_real_model_graph_mode_equals_eager(exe_mode, smollm2_dir, records):
    """npugraph_ex then runs again and must load every bucket from the cache; ge_graph's warm start
    recompiles (frozen weights bypass inductor's FX-graph cache), which the tiny-model tests cover."""
    eager, _ = greedy(smollm2_dir, records)
    graph, summary = greedy(smollm2_dir, records, exe_mode=exe_mode, enable_cache_compile=True)
    assert graph == eager
    assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0
    if exe_mode == "npugraph_ex":
        again, summary = greedy(smollm2_dir, records, exe_mode=exe_mode, enable_cache_compile=True)
        assert again == eager
        assert set(summary["graph"]["bucket_origins"].values()) == {CACHED_ORIGIN[exe_mode]}
