"""The NPU and CUDA graph compilers' wiring, on the CPU where their hardware is absent.

The NPU compilers run here against stand-ins of torchair and torch_npu's npugraph_ex backend
that record how they were called and compile with dynamo's eager backend: this checks that each
passes cann-recipes' settings (GE mode, frozen parameters, tiling sink, StableRDFS; npugraph_ex's
options with one graph pool) and the cache_compile paths, and that the callable it returns computes
the model. The CUDA test runs where torch sees a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.core.model_worker.bucket_padding import pad_step
from executor.core.model_worker.graph_runner import DecodeStep
from executor.platform import npu_runtime
from executor.platform.compile_cache import CompileCache
from executor.platform.graph_compilers import NpuGraphExCompiler, TorchairGeCompiler, graph_compiler_factory
from executor.platform.platform import Platform
from ops.attention.metadata import StepLayout, build_model_inputs
from tests.engine_harness import make_inference, token_records
from tests.npu_stand_ins import Recorder, compiling_torchair, npugraph_ex_npu

NPU_ON_CPU = Platform("npu", torch.device("cpu"))


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(npu_runtime, "torchair", lambda: compiling_torchair(recorder))
    monkeypatch.setattr(npu_runtime, "torch_npu", lambda: None)
    pool = object()
    monkeypatch.setattr(torch, "npu", npugraph_ex_npu(recorder, pool), raising=False)
    recorder.pool = pool  # type: ignore[attr-defined]
    return recorder


@pytest.fixture
def model_and_buffers(tiny_llama_dir):
    """The tiny model bound to a KV cache, and a bucket's buffers with one real decode row."""
    inference = make_inference(tiny_llama_dir, batch_size=2, num_blocks=32)
    inference.generate(token_records([[5, 6, 7]]))
    engine = inference.engine
    layout = pad_step(StepLayout([9], [3], [1], [4], [[[1]]], [[19]], [0], engine.max_blocks_per_request), 2)
    return DecodeStep(engine.worker.model), build_model_inputs(layout, engine.metadata_builder)


def expected(step, buffers) -> torch.Tensor:
    """The eager step's (hidden states, logits), flattened into one tensor for comparison."""
    with torch.inference_mode():
        return torch.cat([t.flatten() for t in step(*buffers.forward_args())])


def test_ge_graph_on_npu_uses_torchair_ge_with_cann_recipes_settings(recorder, model_and_buffers):
    model, buffers = model_and_buffers
    compiler = graph_compiler_factory("npu", "ge_graph")(NPU_ON_CPU, CompileCache(None), num_buckets=1, settings={})
    assert isinstance(compiler, TorchairGeCompiler)
    with torch.inference_mode():
        out = torch.cat([t.flatten() for t in compiler.compile(model, buffers, 2)(buffers)])
    assert torch.allclose(out, expected(model, buffers), atol=1e-5)
    ((name, kwargs),) = recorder.calls
    config = kwargs["compiler_config"]
    assert name == "get_npu_backend" and config.mode == "max-autotune"
    assert config.experimental_config.frozen_parameter and config.experimental_config.tiling_schedule_optimize
    assert config.experimental_config.topology_sorting_strategy == "StableRDFS"


def test_ge_graph_cache_compile_goes_to_the_torchair_folder_with_ge_cache_and_static_shapes(
    recorder, model_and_buffers, tmp_path
):
    model, buffers = model_and_buffers
    compiler = graph_compiler_factory("npu", "ge_graph")(NPU_ON_CPU, CompileCache(tmp_path), num_buckets=1, settings={})
    with torch.inference_mode():
        compiler.compile(model, buffers, 2)(buffers)
    (_, kwargs) = next(call for call in recorder.calls if call[0] == "cache_compile")
    assert Path(kwargs["cache_dir"]) == tmp_path / "torchair" and kwargs["ge_cache"] and kwargs["dynamic"] is False


def test_npugraph_ex_on_npu_compiles_with_its_backend_options_and_one_pool(recorder, model_and_buffers, monkeypatch):
    model, buffers = model_and_buffers
    seen: dict = {}
    real_compile = torch.compile

    def compile_spy(target, *, backend, options=None, **kwargs):
        seen.update(backend=backend, options=options, **kwargs)
        return real_compile(target, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_spy)
    compiler = graph_compiler_factory("npu", "npugraph_ex")(
        NPU_ON_CPU, CompileCache(None), num_buckets=1, settings={}, static_kernel=True
    )
    assert isinstance(compiler, NpuGraphExCompiler)
    with torch.inference_mode():
        out = torch.cat([t.flatten() for t in compiler.compile(model, buffers, 2)(buffers)])
    assert torch.allclose(out, expected(model, buffers), atol=1e-5)
    assert seen["backend"] == "npugraph_ex" and seen["fullgraph"] and seen["dynamic"] is False
    assert seen["options"]["use_graph_pool"] is recorder.pool and seen["options"]["static_kernel_compile"]
    assert seen["options"]["frozen_parameter"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("exe_mode", ["ge_graph", "npugraph_ex"])
def test_cuda_graph_modes_equal_eager(exe_mode, tiny_llama_dir):
    records = token_records([[3 + i, 40 + i, 7, 9 + 2 * i][: 2 + i % 3] for i in range(5)])
    settings = {"batch_size": 4, "graph_buckets": [1, 2, 4], "num_blocks": 64, "max_new_tokens": 12}
    eager = make_inference(tiny_llama_dir, model_config={"device": "cuda"}, **settings).generate(records)
    graph = make_inference(tiny_llama_dir, model_config={"device": "cuda", "exe_mode": exe_mode}, **settings)
    result = graph.generate(records)
    assert [r.output_token_ids for r in result.requests] == [r.output_token_ids for r in eager.requests]
    assert sum(result.summary["graph"]["graph_steps_per_bucket"].values()) > 0
