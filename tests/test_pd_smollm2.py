"""The real default model as two processes of prefill-decode disaggregation behind the Router's
process, as users start them (`python -m executor.online --pd-role prefill|decode`, `python -m
executor.online.router`): greedy chat tokens equal to the offline run's in fp32 (which
tests/test_online_smollm2.py holds the combined server to), one at a time and eight at once; then
the prefill process is killed: the Router answers 503, the decode instance stays healthy with an
empty pool (slow: three processes start)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.online_harness import ROOT, free_port, printed, server_process
from tests.test_online_smollm2 import EAGER, MAX_TOKENS, chat_tokens, messages, offline_tokens  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

# a small pool each (three processes share the machine), eight requests at once
INSTANCE = ["--set", "scheduler_config.batch_size=8", "--set", "scheduler_config.num_blocks=64"]


@contextlib.contextmanager
def router_process(prefill_url: str, decode_url: str) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "executor.online.router", "--port", str(port)]
    command += ["--prefill", prefill_url, "--decode", decode_url]
    log = tempfile.TemporaryFile("w+")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert process.poll() is None, f"the router exited: {printed(process)}"
            assert time.monotonic() < deadline, "the router did not start in time"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield base + "/v1"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_default_model_through_prefill_decode_and_the_router_equals_offline(messages, offline_tokens):  # noqa: F811
    prefill_args = ["--pd-role", "prefill", "--set", "disagg_config.bootstrap_port=0", *INSTANCE]
    with (
        server_process(EAGER, *prefill_args, timeout_s=1200) as (prefill_url, prefill),
        server_process(EAGER, "--pd-role", "decode", *INSTANCE, timeout_s=1200) as (decode_url, decode),
        router_process(prefill_url.removesuffix("/v1"), decode_url.removesuffix("/v1")) as router_url,
    ):
        one_by_one = [chat_tokens(router_url, m) for m in messages[:3]]
        with ThreadPoolExecutor(len(messages)) as pool:
            together = list(pool.map(lambda m: chat_tokens(router_url, m), messages))
        assert one_by_one == offline_tokens[:3]
        assert together == offline_tokens
        assert all(len(tokens) <= MAX_TOKENS for tokens in together)
        decode_base = decode_url.removesuffix("/v1")
        stats = httpx.get(decode_base + "/stats").json()
        assert stats["kv_transfers"] == len(messages) + 3 and stats["kv_blocks_used"] == 0
        assert "bootstrap server on" in printed(prefill)

        prefill.kill()  # the prefill instance dies: the Router answers 503, decode goes on
        prefill.wait()
        answer = httpx.post(
            router_url + "/chat/completions", json={"messages": messages[0], "max_tokens": 4}, timeout=120
        )
        assert answer.status_code == 503, answer.text
        assert httpx.get(decode_base + "/health").status_code == 200
        deadline = time.monotonic() + 10  # the Router closed the decode half: its server aborts it
        while (stats := httpx.get(decode_base + "/stats").json())["num_in_transfer"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats["num_in_transfer"] == 0 and stats["kv_blocks_used"] == 0
    assert decode.returncode == 0, printed(decode)
