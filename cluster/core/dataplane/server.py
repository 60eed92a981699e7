"""The serving side of the TCP data plane: a threaded server bound to the node's address.

    accept thread (socketserver)  ->  one thread per connection, for the connection's life:
        wait for a request (an idle connection wakes every IDLE_TICK_S to see if we stop)
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

import logging
import select
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.core.dataplane import wire
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.streams import configure, send_gather

log = logging.getLogger("raykv.dataplane")
IDLE_TICK_S = 1.0
MAX_CONNECTIONS = 256


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
    """Serves pages from `source` on (host, an ephemeral port)."""

    def __init__(self, source: PageSource, host: str, timeout_s: float, epoch: int = 0):
        self.source = source
        self.timeout_s = timeout_s
        self.counters = {"accepted": 0, "requests": 0, "served_pages": 0, "served_bytes": 0,
                         "torn_pages": 0, "failed_requests": 0, "refused_connections": 0}
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = _Server((host, 0), _Handler)
        self._server.owner = self
        self.endpoint = Endpoint("tcp", host, self._server.server_address[1], epoch)
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

    def _admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closing.is_set() or len(self._conns) >= MAX_CONNECTIONS:
                self.counters["refused_connections"] += 1
                return False
            self._conns.add(sock)
            self.counters["accepted"] += 1
        return True

    def _serve_connection(self, sock: socket.socket) -> None:
        if not self._admit(sock):
            return
        configure(sock, self.timeout_s)
        try:
            while not self._closing.is_set():
                request = self._next_request(sock)
                if request is None:
                    return
                self._serve_read(sock, request)
        except OSError as error:  # the reader vanished or misbehaved: drop the connection
            self.counters["failed_requests"] += 1
            log.debug("data plane connection ended: %s", error)
        finally:
            with self._lock:
                self._conns.discard(sock)

    def _next_request(self, sock: socket.socket) -> wire.ReadRequest | None:
        """The next request; None when the reader closed the connection or we stop. An idle
        connection wakes every IDLE_TICK_S to check whether the server is closing."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while not self._closing.is_set():
            if poller.poll(IDLE_TICK_S * 1000):
                return wire.read_request(sock)
        return None

    def _serve_read(self, sock: socket.socket, request: wire.ReadRequest) -> None:
        if request.op != wire.OP_READ:  # a PUSH is for a NIXL server (nixl_transport.py)
            raise wire.PeerGone(f"op {request.op} is not served here")
        self.counters["requests"] += 1
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


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = False
    block_on_close = False
    owner: PageServer


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.server.owner._serve_connection(self.request)
