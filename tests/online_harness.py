"""The online server on a small model, in this process (uvicorn on a thread) or as its own process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from executor.core.config.sections import DisaggConfig
from executor.core.engine import ExecutionEngine
from executor.online.__main__ import build_server
from executor.online.disagg.loop import DisaggEngineLoop
from executor.online.engine_loop import EngineLoop
from executor.online.router import Router, RouterSettings
from executor.online.server import OnlineServer
from tests.engine_harness import make_inference

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT/v1
    server: OnlineServer
    loop: EngineLoop
    engine: ExecutionEngine

    def metric(self, name: str) -> float:
        """One unlabelled figure of GET /metrics."""
        text = httpx.get(self.base_url.removesuffix("/v1") + "/metrics").text
        for line in text.splitlines():
            if line.startswith(f"infer_recipes:{name} "):
                return float(line.split()[-1])
        raise KeyError(name)

    def aborted_count(self) -> float:
        """Requests that finished aborted, as /metrics counts them."""
        text = httpx.get(self.base_url.removesuffix("/v1") + "/metrics").text
        label = 'infer_recipes:request_success_total{finished_reason="abort"} '
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(label)), 0.0)


@contextlib.contextmanager
def serving(
    model_dir: Path,
    *,
    max_waiting_requests: int = 64,
    served_model_name: str | None = None,
    disagg: DisaggConfig | None = None,
    **scheduler: object,
) -> Iterator[RunningServer]:
    """The server over an engine like the offline tests' (make_inference), on a free port; with
    `disagg`, a prefill or decode instance of prefill-decode disaggregation."""
    engine = make_inference(model_dir, **scheduler).engine
    if disagg is None:
        loop = EngineLoop(engine, max_waiting_requests)
    else:
        loop = DisaggEngineLoop(engine, max_waiting_requests, disagg)
    port = free_port()
    server, uvicorn_server = build_server(engine, loop, "127.0.0.1", port, served_model_name, graceful_timeout_s=10)
    loop.start()
    try:
        with running_uvicorn(uvicorn_server):
            yield RunningServer(f"http://127.0.0.1:{port}/v1", server, loop, engine)
    finally:
        loop.stop(timeout_s=15)


@contextlib.contextmanager
def running_uvicorn(uvicorn_server: uvicorn.Server) -> Iterator[None]:
    """`uvicorn_server` on a thread, started (bounded) and joined at the end."""
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        uvicorn_server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def routing(prefill_urls: list[str], decode_urls: list[str]) -> Iterator[str]:
    """The prefill-decode Router over the instances (their base URLs, without /v1) on a free port:
    its base URL with /v1."""
    router = Router(RouterSettings(prefill_urls, decode_urls, request_timeout_s=120))
    port = free_port()
    config = uvicorn.Config(router.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    with running_uvicorn(uvicorn.Server(config)):
        yield f"http://127.0.0.1:{port}/v1"


def health_ok(url: str) -> bool:
    """Whether `url` (a /health) answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def routed_greedy(
    router_url: str, decode_base: str, prompts: list[list[int]], expected: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """Greedy tokens of `prompts` sent at once through the Router at `router_url` (with /v1) equal
    `expected`; then the decode instance's pool (at its base URL) empties (bounded): its /stats."""

    def tokens(prompt: list[int]) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        answer = httpx.post(router_url + "/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(tokens, prompts)) == expected
    deadline = time.monotonic() + 10  # the figures are as of each replica's last step
    while (stats := httpx.get(decode_base + "/stats").json())["kv_blocks_used"]:
        assert time.monotonic() < deadline, f"the decode instance holds blocks after the load: {stats}"
        time.sleep(0.2)
    assert stats["num_in_flight"] == 0 and stats["num_running"] == 0
    return stats


def printed(process: subprocess.Popen) -> str:
    """What a server_process printed so far."""
    process.log.seek(0)  # type: ignore[attr-defined]
    return process.log.read()  # type: ignore[attr-defined]


@contextlib.contextmanager
def server_process(
    yaml: Path, *extra: str, timeout_s: float = 240, torchrun: int = 0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m executor.online` (through torchrun with `torchrun` ranks) on a free port; the
    base URL and the process, stopped with SIGTERM at the end (its exit status is the caller's to check)."""
    port = free_port()
    module = ["-m", "executor.online", "--yaml", str(yaml), "--port", str(port), *extra]
    if torchrun:
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "--master-port", str(free_port())]
        command = [sys.executable, *launcher, *module]
    else:
        command = [sys.executable, *module]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log  # type: ignore[attr-defined]  # what it printed, for the caller's asserts
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert process.poll() is None, f"the server exited: {printed(process)}"
            assert time.monotonic() < deadline, "the server did not start in time"
            if health_ok(base + "/health"):
                break
            time.sleep(0.5)
        yield base + "/v1", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
