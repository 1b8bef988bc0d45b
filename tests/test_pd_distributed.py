"""A decode instance of two data-parallel replicas under torchrun (each replica meeting the prefill
instance with a pair group of its own), fed by a one-rank prefill instance through the Router:
greedy tokens equal to the offline run's for requests spread over both replicas (slow: torchrun).
Prefill tensor parallelism (its KV split by heads over the ranks) is not built: refused at start."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from executor.offline.dataset import PromptRecord
from tests.engine_harness import ENGINE_PROMPT_LENS, make_inference
from tests.online_harness import routing, server_process
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
        server_process(yaml, *decode_args, timeout_s=600, torchrun=2) as (decode_url, decode),
        routing([prefill_url.removesuffix("/v1")], [decode_url.removesuffix("/v1")]) as router_url,
    ):

        def tokens(prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
            answer = httpx.post(router_url + "/completions", json=body, timeout=300)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(tokens, prompts)) == expected
        deadline = time.monotonic() + 10  # the figures are each replica's as of its last step
        while (stats := httpx.get(decode_url.removesuffix("/v1") + "/stats").json())["kv_blocks_used"]:
            assert time.monotonic() < deadline, f"the decode replicas hold blocks after the load: {stats}"
            time.sleep(0.2)
        assert stats["num_in_flight"] == 0
