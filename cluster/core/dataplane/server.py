"""The serving side of the TCP data plane: a threaded server bound to the node's address, on
the first free port of [first_port, first_port + PORT_SPAN) (a NetworkPolicy names them).

    accept thread (socketserver)  ->  one thread per connection, for the connection's life:
        admit: within MAX_CONNECTIONS, MAX_PER_PEER per source address and
               MAX_PENDING_PER_PEER not yet authenticated per address; when MAX_PENDING are
               waiting on their handshake, the oldest of the address holding the most is shed
               (closed) for the newcomer, so a few addresses that connect and say nothing
               cannot lock out everyone else, and a reader's own handshake (one round trip)
               outlives the flood unless MAX_PENDING connections arrive within it
        handshake: the reader proves the peer key within HANDSHAKE_S, else it is closed
        wait for a request (an idle connection wakes every IDLE_TICK_S to see if we stop;
               one idle for IDLE_TIMEOUT_S is closed)
        check the request's tag (guard.permits): a refusal is STATUS_REFUSED, no pages
        source.open(request)          pins pages, on the owner's event loop
        reply header + page bytes     straight from the slab mapping (sendall: one copy)
        wait for ACK (bounded)        the reader holds every byte now
        source.verify(...)            generations unchanged since the pin? -> verdict
        source.close(...)             unpin (always, also when the reader vanished)

The pins are held until the reader has everything, so a slot cannot be reused under bytes
still in flight. No state of the store is touched here: the source runs that on the owner's
loop. Connections are counted and closed on close().
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import socketserver
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.core.dataplane import wire
from cluster.core.dataplane.auth import Guard, server_handshake
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.streams import configure, send_gather

log = logging.getLogger("raykv.dataplane")
IDLE_TICK_S = 1.0
IDLE_TIMEOUT_S = 60.0
HANDSHAKE_S = 2.0
MAX_CONNECTIONS = 256
MAX_PER_PEER = 64
MAX_PENDING = 64
MAX_PENDING_PER_PEER = 8
PORT_SPAN = 16


@dataclass(frozen=True, slots=True)
class Listen:
    """Where a page server listens and whom it admits: `host`, the first free port of
    [first_port, first_port + PORT_SPAN) (0: any free port), readers proving guard's key."""

    host: str
    first_port: int
    guard: Guard


@dataclass(frozen=True, slots=True)
class ServedPages:
    """Pinned pages being sent: their bytes (1-D uint8 views of the slots) and the pin."""

    pages: tuple[torch.Tensor, ...]
    lease: object


class PageSource(Protocol):
    """What a page server reads from (the node's store, through its event loop)."""

    def open(self, request: wire.ReadRequest) -> ServedPages | None:
        """Pin the longest held prefix of the request's keys; None when none is held."""

    def verify(self, served: ServedPages) -> int:
        """How many leading pages are still the ones pinned (generations unchanged)."""

    def close(self, served: ServedPages) -> None:
        """Unpin; called exactly once per opened ServedPages."""


class PageServer:
    """Serves pages from `source` to readers that prove the service's credential."""

    def __init__(self, source: PageSource, listen: Listen, timeout_s: float, epoch: int = 0):
        self.source = source
        self.guard = listen.guard
        self.timeout_s = timeout_s
        self.counters = {"accepted": 0, "requests": 0, "served_pages": 0, "served_bytes": 0,
                         "torn_pages": 0, "failed_requests": 0, "refused_connections": 0,
                         "failed_handshakes": 0, "refused_requests": 0, "idle_closed": 0,
                         "shed_handshakes": 0}
        self._conns: set[socket.socket] = set()
        self._per_peer: Counter[str] = Counter()
        self._pending: dict[str, list[socket.socket]] = {}  # per address, oldest first
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = _bind(listen)
        self._server.owner = self
        self.endpoint = Endpoint("tcp", listen.host, self._server.server_address[1], epoch)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.5,),
                                        name="raykv-dataplane-accept", daemon=True)
        self._thread.start()

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    def stats(self) -> dict:
        return {"transport": "tcp", "endpoint": f"{self.endpoint.host}:{self.endpoint.port}",
                "connections": self.num_connections, **self.counters}

    def close(self) -> None:
        """Stop listening and close every connection (their threads end)."""
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ---- one connection ---------------------------------------------------------------------

    def _admit(self, sock: socket.socket, peer: str) -> bool:
        with self._lock:
            if (self._closing.is_set() or len(self._conns) >= MAX_CONNECTIONS
                    or self._per_peer[peer] >= MAX_PER_PEER
                    or len(self._pending.get(peer, ())) >= MAX_PENDING_PER_PEER):
                self.counters["refused_connections"] += 1
                return False
            shed = self._shed_one() if self._num_pending() >= MAX_PENDING else None
            self._conns.add(sock)
            self._per_peer[peer] += 1
            self._pending.setdefault(peer, []).append(sock)
            self.counters["accepted"] += 1
        if shed is not None:
            _hang_up(shed)  # its thread's handshake fails and it releases its place
        return True

    def _num_pending(self) -> int:
        return sum(len(socks) for socks in self._pending.values())

    def _shed_one(self) -> socket.socket:
        """The oldest pending connection of the address holding the most, taken off the
        pending lists (under the lock); the caller hangs it up."""
        peer = max(self._pending, key=lambda p: len(self._pending[p]))
        victim = self._pending[peer].pop(0)
        if not self._pending[peer]:
            del self._pending[peer]
        self.counters["shed_handshakes"] += 1
        return victim

    def _release(self, sock: socket.socket, peer: str) -> None:
        with self._lock:
            self._conns.discard(sock)
            _decrement(self._per_peer, peer)
            self._unlist_pending(sock, peer)

    def _unlist_pending(self, sock: socket.socket, peer: str) -> None:
        socks = self._pending.get(peer)
        if socks is not None and sock in socks:
            socks.remove(sock)
            if not socks:
                del self._pending[peer]

    def _serve_connection(self, sock: socket.socket, peer: str) -> None:
        if not self._admit(sock, peer):
            return
        pending = True
        try:
            session = self._handshake(sock)
            with self._lock:
                self._unlist_pending(sock, peer)
            pending = False
            if session is None:
                return
            configure(sock, self.timeout_s)
            while not self._closing.is_set():
                request = self._next_request(sock, session)
                if request is None:
                    return
                self._serve_read(sock, request)
        except OSError as error:  # the reader vanished or misbehaved: drop the connection
            self.counters["failed_requests" if not pending else "failed_handshakes"] += 1
            log.debug("data plane connection ended: %s", error)
        finally:
            self._release(sock, peer)

    def _handshake(self, sock: socket.socket) -> bytes | None:
        """The session of a reader that proved the peer key within HANDSHAKE_S; None (and a
        count) for one that did not."""
        configure(sock, HANDSHAKE_S)
        session = server_handshake(sock, self.guard.peer_key,
                                   time.monotonic() + HANDSHAKE_S)
        if session is None:
            self.counters["failed_handshakes"] += 1
        return session

    def _next_request(self, sock: socket.socket, session: bytes) -> wire.ReadRequest | None:
        """The next request; None when the reader closed the connection, it stayed idle for
        IDLE_TIMEOUT_S, or we stop. An idle connection wakes every IDLE_TICK_S to check
        whether the server is closing."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        idle_since_s = time.monotonic()
        while not self._closing.is_set():
            if poller.poll(IDLE_TICK_S * 1000):
                return wire.read_request(sock, session)
            if time.monotonic() - idle_since_s > IDLE_TIMEOUT_S:
                self.counters["idle_closed"] += 1
                return None
        return None

    def _serve_read(self, sock: socket.socket, request: wire.ReadRequest) -> None:
        if request.op != wire.OP_READ:  # a PUSH is for a NIXL server (nixl_transport.py)
            raise wire.PeerGone(f"op {request.op} is not served here")
        self.counters["requests"] += 1
        if not self.guard.permits(request.claim):
            self.counters["refused_requests"] += 1
            sock.sendall(wire.REPLY.pack(wire.STATUS_REFUSED, 0, request.geometry.page_bytes))
            return
        served = self.source.open(request)
        if served is None:
            sock.sendall(wire.REPLY.pack(wire.STATUS_OK, 0, request.geometry.page_bytes))
            return
        try:
            deadline_s = time.monotonic() + self.timeout_s
            page_bytes = request.geometry.page_bytes
            sock.sendall(wire.REPLY.pack(wire.STATUS_OK, len(served.pages), page_bytes))
            send_gather(sock, [_host_bytes(page) for page in served.pages], deadline_s)
            if wire.recv_exact(sock, len(wire.ACK)) != wire.ACK:
                raise wire.PeerGone("no ACK after the pages")
            good = self.source.verify(served)
            self.counters["served_pages"] += good
            self.counters["served_bytes"] += good * page_bytes
            self.counters["torn_pages"] += len(served.pages) - good
            sock.sendall(wire.VERDICT.pack(good))
        finally:
            self.source.close(served)


def _host_bytes(page: torch.Tensor) -> memoryview:
    """A page's bytes for the socket: a view of a host slot, or a staged copy of a VRAM one."""
    host = page.cpu() if page.is_cuda else page  # .cpu() waits for the copy (synchronous)
    return memoryview(host.numpy())


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone


def _decrement(counts: Counter, peer: str) -> None:
    counts[peer] -= 1
    if counts[peer] <= 0:
        del counts[peer]


def _bind(listen: Listen) -> _Server:
    """A server on the first free port of the listen's range (any free one for port 0)."""
    ports = [0] if listen.first_port == 0 else range(listen.first_port,
                                                     listen.first_port + PORT_SPAN)
    for port in ports:
        try:
            return _Server((listen.host, port), _Handler)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no free page port on {listen.host} in "
                  f"{listen.first_port}-{listen.first_port + PORT_SPAN - 1} (page_port)")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted node actor takes its port back (Linux: never
    block_on_close = False      # two listeners on one port)
    request_queue_size = 128  # connects past the backlog wait seconds on SYN retries
    owner: PageServer


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.server.owner._serve_connection(self.request, self.client_address[0])
