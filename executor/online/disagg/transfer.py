"""The KV transfer between a prefill and a decode instance: control over ZMQ, data over a
torch.distributed process group of two made for each (prefill rank, decode rank) pair.

Control (pyzmq, as cann-recipes): each prefill rank binds a ROUTER socket and registers it in the
bootstrap server; a decode rank meets a prefill instance when a request first names its bootstrap
server: it reads the rank table and, for every rank in it (a tensor-parallel prefill instance's
ranks each hold a share of every request's KV heads, and a decode rank holds them all), connects a
DEALER socket, says `hello`, and both sides make their pair group on the prefill leader's TCPStore
(a PrefixStore per pair, so pairs never collide). Then, per request (a "room", the id the Router
gives both sides), with every prefill rank:

    decode                                   prefill rank
    want(room, its block ids)  ------------>  (the prefill step runs; its KV is gathered, blocks freed)
                               <------------  kv(room, first token, parts)   then the buffer, on the pair group
    or                         <------------  failed(room, why)
    drop(room) (aborted)       ------------>

Data: one flat buffer per request and prefill rank (kv_copy.KVCopier), sent point to point in the
order of the `kv` headers, so each pair's stream needs no tags; once every rank's share of a room is
in, the decode rank joins them (kv_copy.assemble) into the buffer its own cache takes. gloo
carries it on the CPU (and here, in tests); NCCL and HCCL are made against their own process-group
classes for device-resident caches (make_pair_group; docs/distributed.md says why a group of two
and not a transfer engine).

Every wait is bounded: meeting a prefill instance and each transfer by
disagg_config.transfer_timeout_s, each named in the error the request fails with. A prefill rank
dying mid-transfer breaks the links to its instance: the requests waiting on it fail at once, the
next request that names it meets it afresh.

Each side runs one thread that owns its sockets and pair groups; the engine's thread talks to it
through queues only (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq

from executor.online.disagg.bootstrap import RankEntry, fetch_route
from executor.online.disagg.kv_copy import PartMeta, assemble
from executor.platform import npu_runtime
from executor.types_ import TokenLogprobs

logger = logging.getLogger(__name__)

POLL_MS = 5  # a transfer thread's longest sleep between two looks at its sockets and queue
TRANSFER_ERROR = "KV transfer failed"  # what a request failed by the transfer says first (the server's 503)


def make_pair_group(backend: str, store: dist.Store, rank: int, timeout_s: float) -> Any:
    """A process group of two (prefill rank 0, decode rank 1) on `store`, of `backend`: gloo (the
    CPU; tested), NCCL (CUDA) or HCCL (Ascend), each made with its own class so that no
    default group is needed; the latter two are imported only when asked for."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if backend == "hccl":
        hccl = npu_runtime.torch_npu()._C._distributed_c10d.ProcessGroupHCCL
        options = hccl.Options()
        options._timeout = timeout
        return hccl(store, rank, 2, options)
    raise ValueError(f"disagg_config.transfer_backend {backend!r}: gloo, nccl or hccl")


def staging_device(backend: str, cache_device: torch.device) -> torch.device:
    """Where the buffer travels from: the host for gloo, the cache's device for NCCL / HCCL."""
    return torch.device("cpu") if backend == "gloo" else cache_device


@dataclass(slots=True)
class Prefilled:
    """A request's prefill, ready to hand over: its first token(s) and its KV, gathered."""

    room: str
    first_token_ids: list[int]
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs]
    metas: list[PartMeta]
    buffer: torch.Tensor
    ready_s: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Arrival:
    """What a decode rank received for a room: the prefill's tokens and KV, or why not."""

    room: str
    error: str | None = None
    first_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    metas: list[PartMeta] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    nbytes: int = 0
    transfer_s: float = 0.0


@dataclass(slots=True)
class TransferStats:
    """Per side, since start: what /stats shows beside the engine's figures."""

    num_transfers: int = 0
    num_failed: int = 0
    bytes_sent: int = 0  # or received
    transfer_s: float = 0.0  # time in the data path's send (or receive)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "kv_transfers": self.num_transfers,
            "kv_transfers_failed": self.num_failed,
            "kv_transfer_bytes": self.bytes_sent,
            "kv_transfer_s": self.transfer_s,
        }


class _Thread:
    """A transfer side's thread, with its queue from the engine's thread."""

    def __init__(self, name: str) -> None:
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.turn()
        except BaseException as exc:  # the side stops taking work; its requests time out and fail
            logger.exception("the KV transfer thread %s stopped", self._thread.name)
            self.error = exc
        finally:
            self.close()

    def turn(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PrefillTransfer(_Thread):
    """A prefill rank's side: takes `want`s from decode ranks and the engine's finished prefills,
    and sends each prefill's KV to the decode rank that wants it."""

    def __init__(
        self,
        local_ip: str,
        store: dist.Store,
        store_host: str,
        store_port: int,
        *,
        backend: str,
        timeout_s: float,
        rank: int = 0,
    ) -> None:
        super().__init__("pd-prefill-transfer")
        self.backend = backend
        self.timeout_s = timeout_s
        self.store = store
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{local_ip}")
        self.entry = RankEntry(rank, f"tcp://{local_ip}:{port}", store_host, store_port)
        self.stats = TransferStats()
        self._ready: dict[str, Prefilled] = {}
        self._failed: dict[str, tuple[str, float]] = {}  # room -> (why, since)
        self._wants: dict[str, tuple[bytes, float]] = {}  # room -> (the decode rank's socket identity, since)
        self._pairs: dict[bytes, Any] = {}  # decode socket identity -> pair group
        self._pair_ids = itertools.count()

    # -- the engine's thread ----------------------------------------------------------------

    def publish(self, prefilled: Prefilled) -> None:
        """A request's prefill is done and its KV gathered (its blocks may be freed now)."""
        self.inbox.put(("ready", prefilled))

    def fail(self, room: str, why: str) -> None:
        """The request of `room` will never be prefilled here (rejected, aborted, failed)."""
        self.inbox.put(("failed", (room, why)))

    # -- the transfer thread ------------------------------------------------------------------

    def turn(self) -> None:
        if self.socket.poll(POLL_MS):
            identity, message = self.socket.recv_multipart()
            self._on_message(identity, _loads(message))
        while True:
            try:
                kind, item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "ready":
                self._ready[item.room] = item
            else:
                self._failed[item[0]] = (item[1], time.monotonic())
        self._send_matched()
        self._expire()

    def _on_message(self, identity: bytes, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "hello":
            key = f"pd/{message['decode_id']}/{self.entry.rank}/{next(self._pair_ids)}"  # ranks share one store
            self._reply(identity, {"op": "welcome", "pair_key": key})
            try:
                self._pairs[identity] = make_pair_group(
                    self.backend, dist.PrefixStore(key, self.store), 0, self.timeout_s
                )
            except RuntimeError as exc:
                logger.warning("could not make the pair group with decode rank %s: %s", message["decode_id"], exc)
                return
            logger.info("met decode rank %s (pair group %s, %s)", message["decode_id"], key, self.backend)
        elif op == "want":
            self._wants[message["room"]] = (identity, time.monotonic())
        elif op == "drop":
            self._wants.pop(message["room"], None)
            self._ready.pop(message["room"], None)
        else:
            logger.warning("unknown KV transfer message %r", op)

    def _send_matched(self) -> None:
        for room in [room for room in self._wants if room in self._ready or room in self._failed]:
            identity, _ = self._wants.pop(room)
            if room in self._failed:
                why, _ = self._failed.pop(room)
                self._reply(identity, {"op": "failed", "room": room, "error": why})
                continue
            self._send(identity, self._ready.pop(room))

    def _send(self, identity: bytes, prefilled: Prefilled) -> None:
        pair = self._pairs.get(identity)
        if pair is None:
            self._reply(identity, {"op": "failed", "room": prefilled.room, "error": "no pair group with this rank"})
            return
        buffer = prefilled.buffer.to(staging_device(self.backend, prefilled.buffer.device))
        header = {
            "op": "kv",
            "room": prefilled.room,
            "first_token_ids": prefilled.first_token_ids,
            "logprobs": prefilled.logprobs,
            "prompt_logprobs": prefilled.prompt_logprobs,
            "metas": prefilled.metas,
            "nbytes": buffer.numel(),
        }
        self._reply(identity, header)
        start_s = time.perf_counter()
        try:
            if buffer.numel():
                pair.send([buffer], 1, 0).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # the decode rank died or stalled: its pair is broken
            logger.warning("sending the KV of room %s failed: %s; its pair group is dropped", prefilled.room, exc)
            self._pairs.pop(identity, None)
            self.stats.num_failed += 1
            return
        self.stats.num_transfers += 1
        self.stats.bytes_sent += buffer.numel()
        self.stats.transfer_s += time.perf_counter() - start_s

    def _expire(self) -> None:
        """Drop what no decode rank came for within the timeout (a decode that gave up, or never
        was): the gathered KV of a room is held no longer than that."""
        now_s = time.monotonic()
        for room in [room for room, (_, since) in self._failed.items() if now_s - since > self.timeout_s]:
            del self._failed[room]
        for room in [room for room, item in self._ready.items() if now_s - item.ready_s > self.timeout_s]:
            why = f"no decode rank asked for its KV within {self.timeout_s:g} s (transfer_timeout_s): dropped"
            logger.warning("room %s: %s", room, why)
            del self._ready[room]
            self._failed[room] = (why, now_s)  # a want that comes later is answered, not left to time out
        for room in [room for room, (_, since) in self._wants.items() if now_s - since > 2 * self.timeout_s]:
            del self._wants[room]  # the decode side failed it by now

    def _reply(self, identity: bytes, message: dict[str, Any]) -> None:
        self.socket.send_multipart([identity, _dumps(message)])

    @property
    def num_held(self) -> int:
        """Gathered prefills not sent yet (tests: zero after a load)."""
        return len(self._ready)

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@dataclass(slots=True)
class _Link:
    """One prefill rank as a decode rank talks to it: its control socket and their pair group."""

    rank: int
    socket: zmq.Socket
    pair: Any


@dataclass(slots=True)
class _Shard:
    """What one prefill rank sent for a room: its `kv` header and its buffer."""

    header: dict[str, Any]
    buffer: torch.Tensor
    transfer_s: float


@dataclass(slots=True)
class _Peer:
    """A prefill instance as a decode rank knows it: a link to every rank of it, since this rank
    holds every KV head and each prefill rank of its attention TP group holds a share of them."""

    instance_id: str
    links: list[_Link]  # in rank order
    rooms: dict[str, dict[int, _Shard]] = field(default_factory=dict)  # wanted, not complete: shards by rank
    last_heard_s: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        for link in self.links:
            link.socket.close(0)


class DecodeTransfer(_Thread):
    """A decode rank's side: meets prefill instances as requests name them, asks every rank of one
    for each request's KV, receives their shares, joins them and hands the request's KV to the
    engine's thread (`arrivals`)."""

    def __init__(self, *, backend: str, timeout_s: float, wake: Callable[[], None], device: torch.device) -> None:
        super().__init__("pd-decode-transfer")
        self.backend = backend
        self.timeout_s = timeout_s
        self.wake = wake  # tells the engine loop something arrived
        self.device = device
        self.decode_id = uuid.uuid4().hex[:12]
        self.context = zmq.Context()
        self.arrivals: queue.Queue[Arrival] = queue.Queue()
        self.stats = TransferStats()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._room_peer: dict[str, tuple[str, int]] = {}

    # -- the engine's thread ----------------------------------------------------------------

    def want(self, room: str, bootstrap: tuple[str, int], block_ids: list[list[int]]) -> None:
        """Ask the prefill instance at `bootstrap` for the KV of `room` (its blocks are allocated here)."""
        self.inbox.put(("want", (room, bootstrap, block_ids)))

    def drop(self, room: str, timed_out: bool = False) -> None:
        """The request of `room` ended here (aborted, or `timed_out` waiting): the prefill side may
        drop its KV. A timeout from an instance not heard from within the timeout forgets it, so
        that the next request naming it meets it afresh (it may have restarted)."""
        self.inbox.put(("drop", (room, timed_out)))

    # -- the transfer thread ------------------------------------------------------------------

    def turn(self) -> None:
        while True:
            try:
                kind, item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "want":
                self._want(*item)
            else:
                self._drop(*item)
        if not self._peers:
            time.sleep(POLL_MS / 1e3)
            return
        poller = zmq.Poller()
        links: dict[zmq.Socket, tuple[tuple[str, int], _Link]] = {}
        for key, peer in self._peers.items():
            for link in peer.links:
                poller.register(link.socket, zmq.POLLIN)
                links[link.socket] = (key, link)
        for sock, _ in poller.poll(POLL_MS):
            key, link = links[sock]
            if key in self._peers:  # not broken by an earlier message of this poll
                self._on_message(key, link, _loads(sock.recv()))

    def _want(self, room: str, bootstrap: tuple[str, int], block_ids: list[list[int]]) -> None:
        where = f"{bootstrap[0]}:{bootstrap[1]}"
        try:
            peer = self._peer(bootstrap)
        except (TimeoutError, RuntimeError, zmq.ZMQError) as exc:
            self._fail(room, f"could not meet the prefill instance of bootstrap server {where}: {exc}")
            return
        try:  # never blocks: a prefill rank that stopped reading fills its queue, then this fails
            for link in peer.links:
                link.socket.send(_dumps({"op": "want", "room": room, "block_ids": block_ids}), zmq.NOBLOCK)
        except zmq.Again:
            self._break(bootstrap, f"the prefill instance at bootstrap {where} takes no more")
            self._fail(room, f"the prefill instance at bootstrap {where} takes no more requests")
            return
        peer.rooms[room] = {}
        self._room_peer[room] = bootstrap

    def _drop(self, room: str, timed_out: bool) -> None:
        key = self._room_peer.pop(room, None)
        if key is None or key not in self._peers:
            return
        peer = self._peers[key]
        peer.rooms.pop(room, None)
        for link in peer.links:
            with contextlib.suppress(zmq.Again):  # a drop may be lost: the prefill side expires what it holds
                link.socket.send(_dumps({"op": "drop", "room": room}), zmq.NOBLOCK)
        if timed_out and time.monotonic() - peer.last_heard_s > self.timeout_s:
            self._break(key, f"the prefill instance at bootstrap {key[0]}:{key[1]} went silent")

    def _peer(self, bootstrap: tuple[str, int]) -> _Peer:
        """The links to every rank of the prefill instance at `bootstrap`, met now if not yet
        (bounded: the rank table's read, then each rank's hello, by the timeout)."""
        known = self._peers.get(bootstrap)
        if known is not None:
            return known
        route = fetch_route(*bootstrap, timeout_s=self.timeout_s)
        peer = _Peer(route.instance_id, [])
        stores: dict[tuple[str, int], dist.Store] = {}
        try:
            for entry in route.ranks:
                where = (entry.store_host, entry.store_port)
                if where not in stores:
                    timeout = timedelta(seconds=self.timeout_s)
                    stores[where] = dist.TCPStore(*where, is_master=False, timeout=timeout)
                peer.links.append(self._meet(entry, stores[where]))
        except BaseException:
            peer.close()
            raise
        logger.info(
            "met prefill instance %s: %d rank(s) holding each request's KV, joined here",
            route.instance_id,
            len(peer.links),
        )
        self._peers[bootstrap] = peer
        return peer

    def _meet(self, entry: RankEntry, store: dist.Store) -> _Link:
        """Say hello to one prefill rank and make the pair group with it."""
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(entry.endpoint)
        try:
            sock.send(_dumps({"op": "hello", "decode_id": self.decode_id}), zmq.NOBLOCK)  # a fresh socket queues it
            if not sock.poll(int(self.timeout_s * 1e3)):
                raise TimeoutError(
                    f"the prefill rank at {entry.endpoint} did not answer hello within {self.timeout_s:g} s"
                )
            key = _loads(sock.recv())["pair_key"]
            pair = make_pair_group(self.backend, dist.PrefixStore(key, store), 1, self.timeout_s)
        except BaseException:
            sock.close(0)
            raise
        logger.info("met prefill rank %d at %s (pair group %s)", entry.rank, entry.endpoint, key)
        return _Link(entry.rank, sock, pair)

    def _on_message(self, key: tuple[str, int], link: _Link, message: dict[str, Any]) -> None:
        peer = self._peers[key]
        peer.last_heard_s = time.monotonic()
        room = message["room"]
        where = f"the prefill instance at bootstrap {key[0]}:{key[1]}"
        if message["op"] == "failed":
            if peer.rooms.pop(room, None) is not None:
                self._room_peer.pop(room, None)
                self._fail(room, f"the prefill instance failed it: {message['error']}")
            return
        # the buffer is received whatever became of the room: the pair's stream follows the headers
        buffer = torch.empty(message["nbytes"], dtype=torch.uint8, device=staging_device(self.backend, self.device))
        start_s = time.perf_counter()
        try:
            if buffer.numel():
                link.pair.recv([buffer], 0, 0).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # the prefill rank died mid-transfer, or stalled past the timeout
            self._break(key, f"receiving it from {where} (its rank {link.rank}) failed: {exc}")
            return
        elapsed_s = time.perf_counter() - start_s
        self.stats.num_transfers += 1
        self.stats.bytes_sent += buffer.numel()
        self.stats.transfer_s += elapsed_s
        shards = peer.rooms.get(room)
        if shards is None:
            return  # ended here meanwhile (aborted, timed out, another rank failed it): received, and dropped
        shards[link.rank] = _Shard(message, buffer, elapsed_s)
        if len(shards) < len(peer.links):
            return
        del peer.rooms[room]
        self._room_peer.pop(room, None)
        self._arrived(room, [shards[link.rank] for link in peer.links], where)

    def _arrived(self, room: str, shards: list[_Shard], where: str) -> None:
        """Every rank's share of the room is here: join them and hand the request's KV over."""
        try:
            metas, buffer = assemble([(shard.header["metas"], shard.buffer) for shard in shards])
        except (ValueError, RuntimeError) as exc:
            self._fail(room, f"joining the KV shares of {where} failed: {exc}")
            return
        first = shards[0].header  # every rank sampled the same first token
        self.arrivals.put(
            Arrival(
                room,
                first_token_ids=first["first_token_ids"],
                logprobs=first["logprobs"],
                prompt_logprobs=first["prompt_logprobs"],
                metas=metas,
                buffer=buffer,
                nbytes=sum(shard.buffer.numel() for shard in shards),
                transfer_s=sum(shard.transfer_s for shard in shards),
            )
        )
        self.wake()

    def _break(self, key: tuple[str, int], why: str) -> None:
        """Forget a prefill instance whose pair broke: what still waits on it fails now."""
        peer = self._peers.pop(key)
        peer.close()
        for room in peer.rooms:
            self._room_peer.pop(room, None)
            self._fail(room, why)

    def _fail(self, room: str, why: str) -> None:
        self.stats.num_failed += 1
        self.arrivals.put(Arrival(room, error=f"{TRANSFER_ERROR}: {why}"))
        self.wake()

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self.context.term()


def _dumps(message: dict[str, Any]) -> bytes:
    import pickle  # the two instances trust each other (one deployment); the data path carries no pickle

    return pickle.dumps(message)


def _loads(data: bytes) -> dict[str, Any]:
    import pickle

    return pickle.loads(data)
