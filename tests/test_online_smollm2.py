"""The real default model through the server, against its offline run in fp32: the same greedy
tokens for prompts sent one at a time and by many clients at once, in eager and ge_graph, with
n-gram speculation, and under torchrun at TP 3 and DP 2 (slow: a server start each)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from executor.offline.dataset import load_prompts
from tests.dist_harness import parallel_overrides
from tests.engine_harness import make_inference
from tests.online_harness import ROOT, server_process

pytestmark = pytest.mark.slow

NUM_PROMPTS = 8
MAX_TOKENS = 24
EAGER = ROOT / "models/llama/config/smollm2_135m.yaml"
GE_GRAPH = ROOT / "models/llama/config/smollm2_135m_ge_graph.yaml"
NGRAM = ["--set", "speculative_config.method=ngram", "--set", "speculative_config.num_speculative_tokens=3"]
# graphs for the batch sizes the test makes (one request, all eight at once), so that the server
# compiles two buckets, not six
GRAPH_BUCKETS = ["--set", f"scheduler_config.batch_size={NUM_PROMPTS}", "--set", "scheduler_config.graph_buckets=[1,8]"]


@pytest.fixture(scope="module")
def messages() -> list[list[dict[str, str]]]:
    records = load_prompts(ROOT / "dataset/default.jsonl")[:NUM_PROMPTS]
    return [record.messages or [{"role": "user", "content": record.prompt}] for record in records]


@pytest.fixture(scope="module")
def offline_tokens(smollm2_dir, messages) -> list[list[int]]:
    """The offline engine's greedy tokens for each conversation (fp32, eager)."""
    from executor.offline.dataset import PromptRecord

    records = [PromptRecord(f"m{i}", messages=m) for i, m in enumerate(messages)]
    inference = make_inference(smollm2_dir, batch_size=NUM_PROMPTS, max_new_tokens=MAX_TOKENS, block_size=128)
    return [request.output_token_ids for request in inference.generate(records).requests]


def chat_tokens(base_url: str, messages: list[dict[str, str]]) -> list[int]:
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=300)
    response = client.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    return response.choices[0].token_ids  # type: ignore[attr-defined]


def check_server(yaml: Path, extra: list[str], messages, offline_tokens, torchrun: int = 0) -> None:
    with server_process(yaml, *extra, timeout_s=1200, torchrun=torchrun) as (base_url, process):
        one_by_one = [chat_tokens(base_url, m) for m in messages[:3]]
        with ThreadPoolExecutor(len(messages)) as pool:
            together = list(pool.map(lambda m: chat_tokens(base_url, m), messages))
    if not torchrun:  # SIGTERM: running requests finished, exit 0 (torchrun's agent reports the signal itself)
        assert process.returncode == 0
    assert one_by_one == offline_tokens[:3]
    assert together == offline_tokens


def test_eager_server_equals_offline(messages, offline_tokens):
    check_server(EAGER, [], messages, offline_tokens)


@pytest.mark.long  # two graph compiles: past CI's budget (bash test.sh -m long)
def test_ge_graph_server_with_ngram_equals_offline(messages, offline_tokens):
    check_server(GE_GRAPH, GRAPH_BUCKETS + NGRAM, messages, offline_tokens)


@pytest.mark.long
def test_ge_graph_server_equals_offline(messages, offline_tokens):
    check_server(GE_GRAPH, GRAPH_BUCKETS, messages, offline_tokens)


def test_server_at_tp_3_equals_offline(messages, offline_tokens):
    sizes = dict(attn_tp_size=3, dense_tp_size=3, embed_tp_size=3, lmhead_tp_size=3)
    extra = [word for override in parallel_overrides(3, **sizes) for word in ("--set", override)]
    check_server(EAGER, extra, messages, offline_tokens, torchrun=3)


def test_server_with_2_data_parallel_replicas_equals_offline(messages, offline_tokens):
    extra = [word for override in parallel_overrides(2) for word in ("--set", override)]
    check_server(EAGER, extra, messages, offline_tokens, torchrun=2)
