"""`python -m executor.online --yaml FILE [--host H] [--port N] [--served-model-name NAME]
[--pd-role prefill|decode] [--set k=v ...]`: the OpenAI-compatible server on the recipe's engine
(cann-recipes' online entry); `--port 0` picks a free port and logs it. With `--pd-role` it is one
half of a prefill-decode disaggregated deployment, behind `python -m executor.online.router`
(docs/online.md), which a decode leader starts itself with disagg_config.router_port (and a prefill
leader always starts its Bootstrap server).

Every setting of the YAML that works offline works here; data_config's dataset keys do not apply
(the prompts come over HTTP) and are said so once. With parallel_config.world_size above 1 it runs
as one of torchrun's processes (`python -m executor.online.launch`, or infer.sh --mode online):
rank 0 serves HTTP, the others follow its engine loop. SIGTERM or POST /stop stops taking requests,
lets the running ones finish (aborting what is left after --graceful-timeout-s), and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import uvicorn

from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.comm_manager import DistEnv
from executor.core.config.inference_config import not_applicable_keys
from executor.core.engine import ExecutionEngine
from executor.core.sampler import default_sampling_params
from executor.offline.__main__ import check_model_config
from executor.offline.exit_status import COULD_NOT_START
from executor.offline.preflight import one_line
from executor.online.disagg.loop import DisaggEngineLoop
from executor.online.engine_loop import EngineLoop
from executor.online.server import OnlineServer, ServerSettings
from executor.utils.logging_config import setup_logging

logger = logging.getLogger("executor.online")

DEFAULT_PORT = 8000  # cann-recipes' (and vLLM's)
ROUTER_STOP_S = 10.0  # how long a Router the decode leader started gets to stop
DATASET_KEYS = ("dataset", "dataset_path", "num_prompts", "input_truncated_len", "apply_chat_template")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m executor.online", description=__doc__)
    parser.add_argument("--yaml", required=True, help="the recipe's YAML config")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--served-model-name", default=None, help='a name the model answers to besides "default"')
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=512,
        help="requests that may wait beyond the batch the engine runs; past them a request gets 503 (default 512)",
    )
    parser.add_argument(
        "--graceful-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM or /stop, seconds the running requests get to finish before they are aborted",
    )
    parser.add_argument(
        "--pd-role",
        choices=("prefill", "decode"),
        default=None,
        help="prefill-decode disaggregation: this instance's role (sets disagg_config.disaggregation_mode); "
        "clients go through python -m executor.online.router",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    if args.max_waiting_requests < 0:
        print(f"error: --max-waiting-requests must be >= 0, got {args.max_waiting_requests}", file=sys.stderr)
        return COULD_NOT_START
    overrides = list(args.overrides)
    if args.pd_role is not None:
        overrides.append(f"disagg_config.disaggregation_mode={args.pd_role.upper()}")
    try:
        checked = check_model_config(args.yaml, overrides)
        check_disaggregation(checked.config)
        if DistEnv.from_environ().rank == 0:
            args.port = check_port(args.host, args.port)
            if checked.config.disagg_config.router_port >= 0:  # a busy port found now, 0 picked now
                args.router_port = check_port(args.host, checked.config.disagg_config.router_port)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return COULD_NOT_START
    config = checked.config
    for key, why in not_applicable_keys(config, checked.device_type):
        logger.info("%s is not applicable here, set but unused: %s", key, why)
    logger.info(
        "data_config's %s do not apply online (prompts come over HTTP); its sampling keys are each request's defaults",
        ", ".join(DATASET_KEYS),
    )
    try:
        engine = ExecutionEngine(config, str(checked.model_path))
    except (OSError, RuntimeError, ValueError) as exc:  # ConfigError and WeightLoadError are ValueErrors
        print(f"error: the model could not be loaded: {one_line(exc)}", file=sys.stderr)
        return COULD_NOT_START
    disagg = config.disagg_config
    try:
        if disagg.disaggregation_mode == "NONE":
            loop = EngineLoop(engine, args.max_waiting_requests)
        else:
            loop = DisaggEngineLoop(engine, args.max_waiting_requests, disagg)
    except ConfigError as exc:  # what the loaded model decides (its cache kinds, lock-step replicas)
        print(f"error: {exc}", file=sys.stderr)
        engine.comm.close()
        return COULD_NOT_START
    try:
        if DistEnv.from_environ().rank != 0:
            loop.run()  # follow rank 0's turns until it says stop
            return 0
        return serve(args, engine, loop)
    finally:
        engine.comm.close()


def check_port(host: str, port: int) -> int:
    """The address can be listened on (found before the model loads, not after); the port, a free
    one picked (and logged) for port 0."""
    try:
        with socket.create_server((host, port)) as sock:
            picked: int = sock.getsockname()[1]
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from exc
    if port == 0:
        logger.info("--port 0: listening on free port %d", picked)
    return picked


def check_disaggregation(config: InferenceConfig) -> None:
    """What prefill-decode disaggregation is built for here: a prefill instance of one attention TP
    group (one rank, or its ranks each holding a share of the KV heads), a decode instance of one
    rank or of data-parallel replicas of one, no speculation."""
    mode = config.disagg_config.disaggregation_mode
    if mode == "NONE":
        return
    parallel = config.parallel_config
    if mode == "PREFILL" and (parallel.attn_tp_size != parallel.world_size or parallel.cp_size != 1):
        raise ConfigError(
            f"disagg_config.disaggregation_mode PREFILL in {config.source}: a prefill instance is one attention "
            f"tensor-parallel group here (attn_tp_size = world_size, cp_size 1); got world_size "
            f"{parallel.world_size}, attn_tp_size {parallel.attn_tp_size}, cp_size {parallel.cp_size}: run several "
            "instances behind the Router for more"
        )
    if mode == "DECODE" and (parallel.attn_tp_size != 1 or parallel.cp_size != 1):
        raise ConfigError(
            f"disagg_config.disaggregation_mode DECODE in {config.source}: a decode instance is one rank or "
            f"data-parallel replicas of one here (attn_tp_size 1, cp_size 1); got world_size {parallel.world_size}, "
            f"attn_tp_size {parallel.attn_tp_size}, cp_size {parallel.cp_size}"
        )
    disagg = config.disagg_config
    if disagg.router_port >= 0 and mode != "DECODE":
        raise ConfigError(
            f"disagg_config.router_port {disagg.router_port} in {config.source}: the decode leader starts the Router "
            f"(this is a {mode} instance); set it on the decode instance"
        )
    if disagg.router_port >= 0 and not disagg.router_prefill_urls:
        raise ConfigError(
            f"disagg_config.router_prefill_urls in {config.source}: the Router that router_port starts needs the "
            "prefill instances it sends to (http://host:port each)"
        )
    for url in disagg.router_prefill_urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"disagg_config.router_prefill_urls in {config.source}: {url!r} is not an http:// URL of an instance"
            )
    if config.speculation[0]:
        raise ConfigError(
            f"disagg_config.disaggregation_mode {mode} in {config.source}: speculative decoding "
            f"({config.speculation[0]}) is not built with disaggregation; turn it off"
        )


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, but a SIGTERM or Ctrl-C only begins the graceful stop: uvicorn raises the
    signal again once stopped, which would end the process with it instead of exit status 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def build_server(
    engine: ExecutionEngine,
    loop: EngineLoop,
    host: str,
    port: int,
    served_model_name: str | None,
    graceful_timeout_s: float,
) -> tuple[OnlineServer, uvicorn.Server]:
    """The app over `loop`, and the uvicorn server that runs it (the app's /stop ends that server)."""
    names = ["default"] + ([served_model_name] if served_model_name not in (None, "default") else [])
    defaults = default_sampling_params(engine.config)
    settings = ServerSettings(names, engine.max_model_len, engine.vocab_size, defaults, engine.structured_output)
    server = OnlineServer(loop, engine.tokenizer, settings)
    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=graceful_timeout_s,
        lifespan="off",
    )
    uvicorn_server = _GracefulServer(config)
    server.request_stop = lambda: setattr(uvicorn_server, "should_exit", True)
    return server, uvicorn_server


def serve(args: argparse.Namespace, engine: ExecutionEngine, loop: EngineLoop) -> int:
    """Run the HTTP server on rank 0 until SIGTERM / Ctrl-C / POST /stop; then stop every rank's loop."""
    server, uvicorn_server = build_server(
        engine, loop, args.host, args.port, args.served_model_name, args.graceful_timeout_s
    )
    loop.start()
    names = ", ".join(server.settings.model_names)
    logger.info("serving %s on http://%s:%d/v1 (models: %s)", engine.config.source, args.host, args.port, names)
    disagg = engine.config.disagg_config
    with contextlib.ExitStack() as stack:
        if disagg.router_port >= 0:
            own_url = f"http://{reachable(args.host)}:{args.port}"
            stack.enter_context(router_beside(args.host, args.router_port, disagg.router_prefill_urls, own_url))
        try:
            uvicorn_server.run()  # returns after a graceful shutdown (SIGTERM, Ctrl-C, /stop)
        finally:
            loop.stop(timeout_s=args.graceful_timeout_s)
    if loop.error is not None:
        print(f"error: the engine stopped: {one_line(loop.error)}", file=sys.stderr)
        return 1
    logger.info("stopped")
    return 0


def reachable(host: str) -> str:
    """An address this machine reaches a server listening on `host` at (any address: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


@contextlib.contextmanager
def router_beside(host: str, port: int, prefill_urls: list[str], decode_url: str) -> Iterator[subprocess.Popen]:
    """`python -m executor.online.router` as a process of its own (cann-recipes' sidecar beside the
    decode leader) on host:port, in front of `prefill_urls` and the leader's `decode_url`; stopped
    with SIGTERM when the leader stops, killed after ROUTER_STOP_S."""
    command = [sys.executable, "-m", "executor.online.router", "--host", host, "--port", str(port)]
    command += [arg for url in prefill_urls for arg in ("--prefill", url)] + ["--decode", decode_url]
    process = subprocess.Popen(command)
    logger.info("the Router on http://%s:%d/v1 (pid %d): prefill %s", host, port, process.pid, ", ".join(prefill_urls))
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(ROUTER_STOP_S)
        except subprocess.TimeoutExpired:
            logger.warning("the Router (pid %d) did not stop within %g s: killed", process.pid, ROUTER_STOP_S)
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
