"""Pooled connections to page servers, reused across requests, one pool per process.

    idle[endpoint, peer key] = [sock, sock]   taken by a read, given back when its exchange
                                              completed
    every socket ever opened is tracked, so close() ends the in-flight ones too (stop())

A new connection proves the service's peer key first (auth.client_handshake); its session
is kept with it, for the requests' MACs. A socket whose exchange failed half-way is closed,
never given back: its stream position is unknown. One idle past MAX_IDLE_S is closed rather
than reused: the server ends connections idle past its own, longer, limit.
"""

from __future__ import annotations

import socket
import threading
import time

from cluster.core.dataplane.auth import client_handshake
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.streams import configure

MAX_IDLE_PER_ENDPOINT = 4
MAX_IDLE_S = 20.0  # below the server's IDLE_TIMEOUT_S


class ConnectionPool:
    """Connections to page servers, by endpoint."""

    def __init__(self) -> None:
        self._idle: dict[tuple[Endpoint, bytes], list[tuple[socket.socket, float]]] = {}
        self._open: dict[socket.socket, bytes] = {}  # -> its session
        self._lock = threading.Lock()
        self.counters = {"connects": 0, "reuses": 0, "discards": 0}

    def take(self, endpoint: Endpoint, peer_key: bytes, timeout_s: float) -> socket.socket:
        """An idle connection to `endpoint` opened with `peer_key`, or a new one (OSError when
        it cannot connect, auth.AuthFailed when the server refuses the credential)."""
        stale = []
        with self._lock:
            idle = self._idle.get((endpoint, peer_key), [])
            while idle:
                sock, since_s = idle.pop()
                if time.monotonic() - since_s < MAX_IDLE_S:
                    self.counters["reuses"] += 1
                    return sock
                stale.append(sock)
        for sock in stale:
            self.discard(sock)
        sock = socket.create_connection(endpoint.address, timeout=timeout_s)
        try:
            configure(sock, timeout_s)
            session = client_handshake(sock, peer_key)
        except OSError:
            _close(sock)
            raise
        with self._lock:
            self._open[sock] = session
            self.counters["connects"] += 1
        return sock

    def session(self, sock: socket.socket) -> bytes:
        """The session of a connection taken from this pool (what its requests are MACed
        with); KeyError once it was closed."""
        with self._lock:
            return self._open[sock]

    def give(self, endpoint: Endpoint, peer_key: bytes, sock: socket.socket) -> None:
        """Keep a connection whose exchange completed, for the next read."""
        with self._lock:
            idle = self._idle.setdefault((endpoint, peer_key), [])
            if sock in self._open and len(idle) < MAX_IDLE_PER_ENDPOINT:
                idle.append((sock, time.monotonic()))
                return
        self.discard(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.pop(sock, None)
            self.counters["discards"] += 1
        _close(sock)

    def forget(self, endpoint: Endpoint) -> None:
        """Close the idle connections to an endpoint (its node is gone or restarted)."""
        with self._lock:
            idle = [sock for key in [k for k in self._idle if k[0] == endpoint]
                    for sock, _ in self._idle.pop(key)]
            for sock in idle:
                self._open.pop(sock, None)
        for sock in idle:
            _close(sock)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def close(self) -> None:
        """Close every connection, idle or in use (an in-flight read then fails: a miss)."""
        with self._lock:
            socks, self._open, self._idle = list(self._open), {}, {}
        for sock in socks:
            _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
    except OSError:
        pass
    sock.close()


_shared: ConnectionPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> ConnectionPool:
    """This process's pool (clients and the node actor's pulls share it)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ConnectionPool()
        return _shared


def close_shared_pool() -> None:
    """Close this process's connections (cluster.stop() calls it)."""
    global _shared
    with _shared_lock:
        pool, _shared = _shared, None
    if pool is not None:
        pool.close()
