"""Quantized linears compile in the graph modes: a tiny Llama quantized at load (W8A8 int8 by an
opaque op: the one-kernel VNNI linear, or torch._int_mm on other CPUs; W4A16 groups of 32 and FP8
dequantized with fake-quantized fp8 activations) gives, in ge_graph (inductor, frozen weights, GEMM
autotuning) and npugraph_ex (AOTInductor packages), the same greedy tokens as eager; so does a tiny
Qwen3-MoE in W8A8, whose int8 experts are the layer's buffers too. Both compile with
fullgraph=True, so a graph break in a quantized layer would fail the compile rather than fall back
to eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from executor.offline.dataset import PromptRecord
from tests.engine_harness import make_inference
from tests.factories import qwen_config, tiny_tokenizer
from tests.test_graph_modes import shrinking_batch_records

BUCKETS = [2, 4]


def greedy_outputs(model_dir: Path, records: list[PromptRecord], **model_config: object) -> tuple[list, dict]:
    inference = make_inference(
        model_dir, model_config=model_config, batch_size=4, graph_buckets=BUCKETS, num_blocks=64, max_model_len=128
    )
    result = inference.generate(records)
    return [request.output_token_ids for request in result.requests], result.summary


@pytest.fixture(scope="module")
def records() -> list[PromptRecord]:
    return shrinking_batch_records(seed=2, count=4)


@pytest.fixture(scope="module")
def eager_outputs() -> dict[str, list]:
    """Each scheme's eager tokens, run once for both modes."""
    return {}


@pytest.mark.parametrize("exe_mode", ["ge_graph", "npugraph_ex"])
@pytest.mark.parametrize("quantization", ["w8a8", "w4a16_g32", "fp8"])
def test_a_quantized_model_decodes_the_same_tokens_in_graph_mode_as_eager(
    quantization, exe_mode, tiny_llama_dir, records, eager_outputs
):
    if quantization not in eager_outputs:
        eager_outputs[quantization] = greedy_outputs(tiny_llama_dir, records, quantization=quantization)[0]
    eager = eager_outputs[quantization]
    graph, summary = greedy_outputs(tiny_llama_dir, records, quantization=quantization, exe_mode=exe_mode)
    assert graph == eager
    assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0, "decode steps should run in the graphs"


@pytest.fixture(scope="module")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(qwen_config("qwen3_moe"), dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("exe_mode", ["ge_graph", "npugraph_ex"])
def test_int8_experts_decode_the_same_tokens_in_graph_mode_as_eager(exe_mode, tiny_qwen3_moe_dir, records):
    moe = {"model_name": "qwen3_moe", "quantization": "w8a8"}
    eager, _ = greedy_outputs(tiny_qwen3_moe_dir, records, **moe)
    graph, summary = greedy_outputs(tiny_qwen3_moe_dir, records, **moe, exe_mode=exe_mode)
    assert graph == eager
    assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0, "decode steps should run in the graphs"
