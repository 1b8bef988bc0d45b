"""The Bootstrap server (cann-recipes' bootstrap.py): beside the prefill leader, it holds the
instance's rank table, which each prefill rank registers into and a decode instance reads once per
prefill instance it meets, to find the control socket and the store of the rank holding a
request's KV.

Plain HTTP on a thread of the leader (the standard library's server: a table read once per pair
wants nothing more): PUT /route registers a rank, GET /route answers the table once every rank
of the instance has registered (503 before). `fetch_route` is the decode side's bounded read: it
retries while the prefill instance is not up yet, so either side may start first.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

RETRY_S = 0.2  # between two reads of a route that is not there yet


@dataclass(slots=True)
class RankEntry:
    """Where one prefill rank takes KV-transfer requests, and the store its pair groups meet on."""

    rank: int
    endpoint: str  # tcp://host:port of its ZMQ control socket
    store_host: str
    store_port: int


@dataclass(slots=True)
class RouteTable:
    instance_id: str  # changes when the prefill instance restarts, so decode meets it afresh
    world_size: int
    ranks: list[RankEntry] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.world_size

    @staticmethod
    def from_json(data: dict[str, Any]) -> RouteTable:
        return RouteTable(data["instance_id"], data["world_size"], [RankEntry(**entry) for entry in data["ranks"]])


class BootstrapServer:
    def __init__(self, host: str, port: int, instance_id: str, world_size: int) -> None:
        """Listens on (host, port); port 0 picks a free one (`port` says which)."""
        self.table = RouteTable(instance_id, world_size)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-bootstrap", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("bootstrap server on http://%s:%d/route", self.host, self.port)

    def register(self, entry: RankEntry) -> None:
        with self._lock:
            self.table.ranks = [known for known in self.table.ranks if known.rank != entry.rank] + [entry]
            self.table.ranks.sort(key=lambda known: known.rank)

    def route(self) -> RouteTable | None:
        with self._lock:
            return RouteTable(self.table.instance_id, self.table.world_size, list(self.table.ranks))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(bootstrap: BootstrapServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            table = bootstrap.route()
            if self.path != "/route" or table is None:
                self._answer(404, {"error": f"no such path {self.path}"})
            elif not table.complete:
                self._answer(503, {"error": f"{len(table.ranks)} of {table.world_size} prefill ranks registered"})
            else:
                self._answer(200, asdict(table))

        def do_PUT(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", 0))
                bootstrap.register(RankEntry(**json.loads(self.rfile.read(length))))
            except (TypeError, ValueError) as exc:
                self._answer(400, {"error": f"bad rank entry: {exc}"})
                return
            self._answer(200, {"status": "registered"})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            logger.debug("bootstrap: " + format, *args)

    return Handler


def register_rank(host: str, port: int, entry: RankEntry, timeout_s: float) -> None:
    """PUT a rank's entry into the bootstrap server at host:port (retried until `timeout_s`)."""
    request = urllib.request.Request(
        f"http://{host}:{port}/route", data=json.dumps(asdict(entry)).encode(), method="PUT"
    )
    _retry(lambda: urllib.request.urlopen(request, timeout=RETRY_S * 10).read(), host, port, timeout_s, "register at")


def fetch_route(host: str, port: int, timeout_s: float) -> RouteTable:
    """The prefill instance's rank table, read from its bootstrap server; retried while it is not up
    (or not every rank registered) until `timeout_s`, then TimeoutError naming the server."""

    def read() -> RouteTable:
        with urllib.request.urlopen(f"http://{host}:{port}/route", timeout=RETRY_S * 10) as answer:
            return RouteTable.from_json(json.loads(answer.read()))

    return _retry(read, host, port, timeout_s, "read the rank table of")


def _retry(call: Any, host: str, port: int, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except (OSError, urllib.error.URLError) as exc:  # HTTPError (503: not every rank yet) is a URLError
            if time.monotonic() + RETRY_S > deadline:
                raise TimeoutError(
                    f"could not {what} the bootstrap server http://{host}:{port}/route within {timeout_s:g} s: {exc}"
                ) from exc
            time.sleep(RETRY_S)
