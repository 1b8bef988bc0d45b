"""Quantized checkpoints under tensor parallelism (torchrun, gloo on CPU): each rank cuts its shard
of the weights, scales and zero points, and the run gives one process's tokens.

Weight-only schemes multiply the same dequantized values on every layout, so only the fp32 sum
order differs (FP32_REORDER_BOUND, as tests/test_distributed.py). W8A8 quantizes a row-parallel
layer's input per token over each rank's shard of it (as vLLM and vllm-ascend do), so its scales
differ from one process's by design: the tokens must still agree and the logprobs within W8A8_BOUND.
"""

from __future__ import annotations

import pytest

from executor.offline.quantize_checkpoint import quantize_checkpoint
from tests.dist_harness import max_logprob_difference, parallel_overrides, run_distributed, run_one_process, token_ids
from tests.run_harness import write_run
from tests.test_distributed import save_moe_folder

LOGPROBS = "data_config.logprobs=0"
FP32_REORDER_BOUND = 1e-4
W8A8_BOUND = 0.05


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheme", "bound"),
    [pytest.param("w4a16_asym_g16", FP32_REORDER_BOUND, marks=pytest.mark.long), ("w8a8", W8A8_BOUND)],
)
def test_a_quantized_checkpoint_at_tp_2_gives_one_process_tokens(scheme, bound, tiny_llama_dir, tmp_path):
    checkpoint = quantize_checkpoint(tiny_llama_dir, tmp_path / "q", scheme)
    run_yaml = write_run(tmp_path, checkpoint, num_prompts=4)
    reference = run_one_process(run_yaml, tmp_path / "one_process", LOGPROBS)
    sizes = dict(attn_tp_size=2, dense_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)
    run = run_distributed(run_yaml, tmp_path / "tp2", [LOGPROBS, *parallel_overrides(2, **sizes)])
    assert run.returncode == 0, run.output[-4000:]
    assert token_ids(run.outputs()) == token_ids(reference)
    assert max_logprob_difference(run.outputs(), reference) <= bound


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["w4a16_g16", "w8a8"])
def test_quantized_routed_experts_at_moe_tp_2_agree_with_one_process(scheme, tmp_path):
    """W4A16: one process's tokens. W8A8: each expert's down projection quantizes its input per
    token over the rank's half of the intermediate dim, so free-running text may part on this tiny
    random MoE; teacher forced on the same prompt, the first token and its logprob agree."""
    model_dir = save_moe_folder(tmp_path / "model", "qwen3_moe")
    checkpoint = quantize_checkpoint(model_dir, tmp_path / "q", scheme)
    run_yaml = write_run(tmp_path, checkpoint, num_prompts=4)
    name = "model_config.model_name=qwen3_moe"
    reference = run_one_process(run_yaml, tmp_path / "one_process", name, LOGPROBS)
    sizes = dict(attn_tp_size=2, moe_tp_size=2)
    run = run_distributed(run_yaml, tmp_path / "moe_tp2", [name, LOGPROBS, *parallel_overrides(2, **sizes)])
    assert run.returncode == 0, run.output[-4000:]
    if scheme == "w4a16_g16":
        assert token_ids(run.outputs()) == token_ids(reference)
        assert max_logprob_difference(run.outputs(), reference) <= FP32_REORDER_BOUND
        return
    for request_id, line in run.outputs().items():
        first, expected = line["logprobs"][0], reference[request_id]["logprobs"][0]
        assert line["output_token_ids"][0] == reference[request_id]["output_token_ids"][0]
        assert abs(first["logprob"] - expected["logprob"]) <= W8A8_BOUND
