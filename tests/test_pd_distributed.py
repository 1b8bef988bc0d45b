"""A decode instance of two data-parallel replicas under torchrun (each replica meeting the prefill
instance with a pair group of its own), fed by a one-rank prefill instance through the Router:
greedy tokens equal to the offline run's for requests spread over both replicas (slow: torchrun).
A tensor-parallel prefill instance feeding it: tests/test_pd_tensor_parallel.py."""

from __future__ import annotations

import pytest

from executor.offline.dataset import PromptRecord
from tests.engine_harness import ENGINE_PROMPT_LENS, make_inference
from tests.online_harness import routed_greedy, routing, server_process
from tests.paged_harness import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.long]  # torchrun and three processes: past CI's budget

MAX_TOKENS = 8


def test_prefill_to_a_decode_instance_of_two_replicas_equals_offline(tiny_llama_dir, tmp_path):
    prompts = random_prompts(ENGINE_PROMPT_LENS, seed=5)
    records = [PromptRecord(f"p{i}", prompt_token_ids=ids) for i, ids in enumerate(prompts)]
    for record in records:
        record.sampling_overrides["max_new_tokens"] = MAX_TOKENS
    offline = make_inference(tiny_llama_dir, max_new_tokens=MAX_TOKENS).generate(records)
    expected = [request.output_token_ids for request in offline.requests]
    yaml = tmp_path / "tiny.yaml"
    yaml.write_text(
        f"model_config:\n  model_path: {tiny_llama_dir}\n  dtype: float32\n  device: cpu\n"
        "data_config:\n  apply_chat_template: false\n"
        f"scheduler_config:\n  block_size: 16\n  batch_size: 8\n  max_new_tokens: {MAX_TOKENS}\n  num_blocks: 64\n"
    )
    prefill_args = ["--pd-role", "prefill", "--set", "disagg_config.bootstrap_port=0"]
    decode_args = ["--pd-role", "decode", "--set", "parallel_config.world_size=2"]
    with (
        server_process(yaml, *prefill_args, timeout_s=600) as (prefill_url, _),
        server_process(yaml, *decode_args, timeout_s=600, torchrun=2) as (decode_url, _),
        routing([prefill_url.removesuffix("/v1")], [decode_url.removesuffix("/v1")]) as router_url,
    ):
        stats = routed_greedy(router_url, decode_url.removesuffix("/v1"), prompts, expected, MAX_TOKENS)
        assert 0 < stats["kv_transfers"] < len(prompts)  # replica 0's figures: it received some, replica 1 the rest
