"""`python -m executor.online.router --port R --prefill URL [--prefill URL ...] --decode URL [...]`:
the Router of prefill-decode disaggregation (cann-recipes' router.py, SGLang's mini load balancer).

Each request gets a room id; the Router picks a prefill instance and a decode instance by
`room % N`, adds `bootstrap_room` and the prefill instance's `bootstrap_host` / `bootstrap_port`
(asked once of its GET /bootstrap_info) to the body, and sends it to both at once. The client
gets the decode instance's answer (streamed through as it comes, when `stream` is set); the
prefill instance's answer is dropped unless it failed: a prefill instance that is down, or answers
5xx, gets the client a 503 and the decode half aborted (its KV would never come). A client that
goes away has both halves aborted (their connections closed: each server then aborts its request).

Routes: POST /v1/completions, /v1/chat/completions, /generate; GET /v1/models (the first decode
instance's), /health (200 when every instance answers its /health).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import random
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from executor.core.config import ConfigError
from executor.online.__main__ import check_port
from executor.online.server import error_response
from executor.utils.logging_config import setup_logging

logger = logging.getLogger("executor.online.router")

DEFAULT_PORT = 8000  # cann-recipes' Router port
CONNECT_TIMEOUT_S = 10.0  # reaching an instance
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there


@dataclass(slots=True)
class RouterSettings:
    prefill_urls: list[str]  # http://host:port of each prefill instance
    decode_urls: list[str]
    request_timeout_s: float = 3600.0  # the longest one request may take, end to end
    bootstrap: dict[str, tuple[str, int]] = field(default_factory=dict)  # prefill url -> its bootstrap server


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        if not settings.prefill_urls or not settings.decode_urls:
            raise ValueError("the Router needs at least one --prefill and one --decode instance")
        self.settings = settings
        self._rooms = itertools.count(random.randrange(2**40))
        timeout = httpx.Timeout(settings.request_timeout_s, connect=CONNECT_TIMEOUT_S)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="infer-recipes PD router")
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            app.post(path)(self._route_handler(path))
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        return app

    def _route_handler(self, path: str) -> Any:
        async def handle(raw: Request) -> Response:
            return await self.route(path, raw)

        handle.__name__ = f"route_{path.strip('/').replace('/', '_')}"
        return handle

    async def models(self) -> Response:
        try:
            answer = await self.client.get(self.settings.decode_urls[0] + "/v1/models")
        except httpx.HTTPError as exc:
            return error_response(503, f"decode instance {self.settings.decode_urls[0]} is unreachable: {exc}")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    async def health(self) -> Response:
        urls = self.settings.prefill_urls + self.settings.decode_urls
        answers = await asyncio.gather(*(self._healthy(url) for url in urls))
        down = [url for url, ok in zip(urls, answers, strict=True) if not ok]
        if down:
            return error_response(503, f"instances not healthy: {', '.join(down)}")
        return Response(status_code=200)

    async def _healthy(self, url: str) -> bool:
        try:
            return (await self.client.get(url + "/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _bootstrap_of(self, prefill_url: str) -> tuple[str, int]:
        """The prefill instance's bootstrap server, asked once (and again after a failure)."""
        known = self.settings.bootstrap.get(prefill_url)
        if known is not None:
            return known
        answer = await self.client.get(prefill_url + "/bootstrap_info", timeout=CONNECT_TIMEOUT_S)
        info = answer.json()
        if answer.status_code != 200 or info.get("role") != "prefill":
            raise ValueError(f"{prefill_url} is not a prefill instance (its /bootstrap_info: {info})")
        found = (str(info["bootstrap_host"]), int(info["bootstrap_port"]))
        self.settings.bootstrap[prefill_url] = found
        return found

    async def route(self, path: str, raw: Request) -> Response:
        try:
            body = await raw.json()
        except ValueError as exc:
            return error_response(400, f"malformed JSON body: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        room = next(self._rooms)
        prefill_url = self.settings.prefill_urls[room % len(self.settings.prefill_urls)]
        decode_url = self.settings.decode_urls[room % len(self.settings.decode_urls)]
        try:
            host, port = await self._bootstrap_of(prefill_url)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return error_response(503, f"prefill instance {prefill_url} is unavailable: {exc}")
        body |= {"bootstrap_room": room, "bootstrap_host": host, "bootstrap_port": port}
        prefill = asyncio.ensure_future(self._prefill(prefill_url + path, body))
        if body.get("stream"):
            return await self._streamed(decode_url + path, body, prefill)
        decode = asyncio.ensure_future(self.client.post(decode_url + path, json=body))
        watcher = asyncio.ensure_future(_client_gone(raw))
        try:
            waiting: set[asyncio.Future[Any]] = {decode, prefill, watcher}
            while not decode.done():
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:  # the client went away: both halves' connections are closed below
                    return error_response(499, "client closed the request")
                if prefill in done and not decode.done() and prefill.result() is not None:
                    return self._prefill_failed(prefill_url, prefill.result())
            answer = decode.result()
        except httpx.HTTPError as exc:
            self.settings.bootstrap.pop(prefill_url, None)
            return error_response(503, f"decode instance {decode_url} failed: {type(exc).__name__}: {exc}")
        finally:
            watcher.cancel()
            decode.cancel()
            if not prefill.done():
                prefill.cancel()
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    async def _prefill(self, url: str, body: dict[str, Any]) -> str | None:
        """Send the prefill half; None when it went through (or failed as the decode half will:
        a 4xx), else why not."""
        try:
            answer = await self.client.post(url, json=body | {"stream": False})
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return f"status {answer.status_code}: {answer.text[:300]}" if answer.status_code >= 500 else None

    def _prefill_failed(self, prefill_url: str, why: str) -> Response:
        self.settings.bootstrap.pop(prefill_url, None)  # ask again: it may come back on another port
        return error_response(503, f"prefill instance {prefill_url} failed: {why}")

    async def _streamed(self, url: str, body: dict[str, Any], prefill: asyncio.Future[str | None]) -> Response:
        """The decode half's answer streamed through as it comes; closing it (the client went
        away) closes the decode connection, and the prefill half is cancelled."""
        request = self.client.build_request("POST", url, json=body)
        try:
            answer = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            prefill.cancel()
            return error_response(503, f"decode instance {url} failed: {type(exc).__name__}: {exc}")
        if answer.status_code != 200:
            content = await answer.aread()
            await answer.aclose()
            prefill.cancel()
            return Response(content, status_code=answer.status_code, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()
                if not prefill.done():
                    prefill.cancel()

        return StreamingResponse(chunks(), media_type="text/event-stream")


async def _client_gone(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m executor.online.router", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}); 0: a free one")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill instance (repeat)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode instance (repeat)")
    parser.add_argument("--request-timeout-s", type=float, default=3600.0, help="the longest one request may take")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            print(f"error: --prefill / --decode {url!r}: an http:// URL of an instance", file=sys.stderr)
            return 2
    try:
        router = Router(
            RouterSettings(
                [url.rstrip("/") for url in args.prefill],
                [url.rstrip("/") for url in args.decode],
                args.request_timeout_s,
            )
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        port = check_port(args.host, args.port)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    instances = f"prefill {', '.join(args.prefill)}, decode {', '.join(args.decode)}"
    logger.info("router on http://%s:%d/v1: %s", args.host, port, instances)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(router.app, host=args.host, port=port, log_level="warning", lifespan="off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
