"""Graph modes on the CPU: each exe_mode's greedy output equals eager's, token for token.

Compiled for real (inductor for ge_graph, AOTInductor packages for npugraph_ex) on tiny random
models, with batches that hit several buckets, a batch that fits none, and requests finishing at
different steps so the batch shrinks across buckets; then a second run that takes every bucket from
the compile cache. The real model's graphs are compiled in the slow tests.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from executor.core.engine import engine as engine_module
from executor.offline.dataset import PromptRecord
from executor.offline.offline_inference import OfflineInference
from executor.utils.graph_buckets import Bucket
from ops.attention.metadata import build_model_inputs
from tests.conftest import SlidingLlama, save_tiny_llama
from tests.engine_harness import make_inference, token_records
from tests.factories import make_request

BUCKETS = [1, 2, 4]
# How a second run makes each bucket from a warm compile cache. ge_graph: a bucket whose GEMMs
# inductor autotunes over its own prepacked weights misses inductor's FX-graph cache and is traced
# and lowered again, with the autotuning choices and the built kernels from the cache; one whose
# GEMMs are all the panel op (two rows or more, docs/graph_modes.md) is an FX-graph cache hit.
# npugraph_ex loads its packages.
CACHED_ORIGINS = {
    "ge_graph": {"compiled, autotuning from the cache", "inductor cache hit"},
    "npugraph_ex": {"loaded from the compile cache"},
}
BATCH_SIZE = 6  # decode steps of 5 or 6 rows fit no bucket and run eagerly


def shrinking_batch_records(seed: int, count: int = 7) -> list[PromptRecord]:
    """Prompts of different lengths whose requests stop at different steps (max_new_tokens 3..15)."""
    rng = random.Random(seed)
    records = token_records([[rng.randrange(3, 250) for _ in range(rng.randrange(3, 40))] for _ in range(count)])
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 3 + 2 * index
    return records


def run(model_dir: Path, records: list[PromptRecord], **model_config: object) -> OfflineInference:
    inference = make_inference(
        model_dir,
        model_config=model_config,
        batch_size=BATCH_SIZE,
        graph_buckets=BUCKETS,
        num_blocks=96,
        max_model_len=128,
    )
    inference.result = inference.generate(records)  # type: ignore[attr-defined]
    return inference


def outputs(inference: OfflineInference) -> list[list[int]]:
    return [request.output_token_ids for request in inference.result.requests]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def records() -> list[PromptRecord]:
    return shrinking_batch_records(seed=0)


@pytest.fixture(scope="module")
def eager_outputs(tiny_llama_dir, records) -> list[list[int]]:
    return outputs(run(tiny_llama_dir, records))


@pytest.mark.parametrize("exe_mode", ["ge_graph", "npugraph_ex"])
def test_graph_mode_equals_eager_and_the_second_run_loads_from_the_compile_cache(
    exe_mode, tiny_llama_dir, records, eager_outputs, cache_dir
):
    settings = {"exe_mode": exe_mode, "enable_cache_compile": True, "compile_cache_dir": str(cache_dir)}
    first = run(tiny_llama_dir, records, **settings)
    assert outputs(first) == eager_outputs
    graph = first.result.summary["graph"]
    used = {int(bucket) for bucket, steps in graph["graph_steps_per_bucket"].items() if steps}
    assert used == set(BUCKETS), f"the shrinking batch should pass through every bucket, used {used}"
    assert graph["eager_steps"] > first.result.summary["prefill"]["steps"], "steps of 5-6 rows run eagerly"
    assert set(graph["bucket_origins"].values()) <= {"compiled", *CACHED_ORIGINS[exe_mode]}

    second = run(tiny_llama_dir, records, **settings)
    assert outputs(second) == eager_outputs
    origins = set(second.result.summary["graph"]["bucket_origins"].values())
    assert origins and origins <= CACHED_ORIGINS[exe_mode], origins


def test_ge_graph_engines_in_one_process_keep_their_own_graphs(tiny_llama_dir, records, eager_outputs, tmp_path):
    """A second engine, on other weights, runs its own graphs, and the first engine's next run
    compiles nothing: building an engine drops no other engine's graphs (benchmarks that interleave
    engines would otherwise time a recompile, and without frozen weights, in the first's next run)."""
    first = run(tiny_llama_dir, records, exe_mode="ge_graph")
    other_dir = save_tiny_llama(tmp_path / "other", seed=1)
    other_eager = outputs(run(other_dir, records))
    second = run(other_dir, records, exe_mode="ge_graph")
    assert outputs(second) == other_eager != eager_outputs
    graphs_before = counters["stats"]["unique_graphs"]
    first.result = first.generate(records)  # type: ignore[attr-defined]
    assert outputs(first) == eager_outputs
    assert counters["stats"]["unique_graphs"] == graphs_before


@pytest.mark.slow
def test_ge_graph_with_the_cpp_wrapper_equals_eager(tiny_llama_dir, records, eager_outputs):
    """model_config.graph_cpp_wrapper: inductor's C++ wrapper calls the graphs' kernels, the custom
    ops' optional and list arguments included."""
    graph = run(tiny_llama_dir, records, exe_mode="ge_graph", graph_cpp_wrapper=True)
    assert graph.engine.worker.graph_runner.compiler.inductor_options()["cpp_wrapper"] is True
    assert outputs(graph) == eager_outputs
    assert sum(graph.result.summary["graph"]["graph_steps_per_bucket"].values()) > 0


def test_ge_graph_with_two_cache_groups_equals_eager(ministral_dir, monkeypatch):
    """Sliding-window and full layers: padded rows write the null block of both groups."""
    monkeypatch.setattr(engine_module, "resolve_model", lambda name: (SlidingLlama, transformers.MinistralConfig))
    records = shrinking_batch_records(seed=1)
    for record in records:
        record.sampling_overrides["max_new_tokens"] += 8  # past the window of 8
    eager = run(ministral_dir, records)
    graph = run(ministral_dir, records, exe_mode="ge_graph")
    assert len(graph.engine.worker.kv_cache_groups) == 2
    assert outputs(graph) == outputs(eager)
    assert sum(graph.result.summary["graph"]["graph_steps_per_bucket"].values()) > 0


@pytest.mark.parametrize("exe_mode", ["ge_graph", "npugraph_ex"])
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.05)])
def test_a_graph_decode_step_gives_eager_logits(exe_mode, dtype, tolerance, tiny_llama_dir):
    """The same decode step through the bucket's graph and eagerly. In fp32 the two agree to float
    rounding; in bf16 inductor's fused kernels (RMSNorm, rotary, SiLU in one loop, fp32 inside)
    round differently from eager's op-by-op casts, so logits are held to a tolerance relative to
    their largest magnitude rather than to bit equality."""
    inference = make_inference(
        tiny_llama_dir, dtype, model_config={"exe_mode": exe_mode}, batch_size=4, graph_buckets=[4], num_blocks=32
    )
    engine = inference.engine
    requests = [make_request(f"r{i}", range(3, 9 + 5 * i)) for i in range(3)]
    for request in requests:
        assert engine.kv_cache_manager.allocate_slots(request, request.num_tokens + 1) is not None
        engine.runner.execute(engine.kv_cache_manager.batch([request], [request.num_tokens], is_prefill=True))
        request.num_computed_tokens = request.num_tokens
        request.output_token_ids.append(7)
    _, layout = engine.runner.prepare_inputs(
        engine.kv_cache_manager.batch(requests, [1, 1, 1], is_prefill=False), [[], [], []]
    )
    rows = torch.tensor(layout.logits_indices)
    worker = engine.worker
    with torch.inference_mode():
        eager = worker.compute_logits(worker.forward(build_model_inputs(layout, engine.metadata_builder)), rows)
        _, graph_logits = worker.graph_runner.forward(layout)  # the LM head runs inside the graph
        graph = graph_logits[rows]
    assert worker.graph_runner.steps_per_bucket[Bucket(4)] == 1  # 3 rows padded to the bucket of 4
    scale = eager.float().abs().max()
    assert (graph.float() - eager.float()).abs().max() <= tolerance * scale
    assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
