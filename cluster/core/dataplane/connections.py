"""Pooled connections to page servers, reused across requests, one pool per process.

    idle[endpoint] = [sock, sock]   taken by a read, given back when its exchange completed
    every socket ever opened is tracked, so close() ends the in-flight ones too (stop())

A socket whose exchange failed half-way is closed, never given back: its stream position
is unknown.
"""

from __future__ import annotations

import socket
import threading

from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.streams import configure

MAX_IDLE_PER_ENDPOINT = 4


class ConnectionPool:
    """Connections to page servers, by endpoint."""

    def __init__(self) -> None:
        self._idle: dict[Endpoint, list[socket.socket]] = {}
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.counters = {"connects": 0, "reuses": 0, "discards": 0}

    def take(self, endpoint: Endpoint, timeout_s: float) -> socket.socket:
        """An idle connection to `endpoint`, or a new one (OSError when it cannot connect)."""
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                self.counters["reuses"] += 1
                return idle.pop()
        sock = socket.create_connection(endpoint.address, timeout=timeout_s)
        configure(sock, timeout_s)
        with self._lock:
            self._open.add(sock)
            self.counters["connects"] += 1
        return sock

    def give(self, endpoint: Endpoint, sock: socket.socket) -> None:
        """Keep a connection whose exchange completed, for the next read."""
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if sock in self._open and len(idle) < MAX_IDLE_PER_ENDPOINT:
                idle.append(sock)
                return
        self.discard(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
            self.counters["discards"] += 1
        _close(sock)

    def forget(self, endpoint: Endpoint) -> None:
        """Close the idle connections to an endpoint (its node is gone or restarted)."""
        with self._lock:
            idle = self._idle.pop(endpoint, [])
            self._open.difference_update(idle)
        for sock in idle:
            _close(sock)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def close(self) -> None:
        """Close every connection, idle or in use (an in-flight read then fails: a miss)."""
        with self._lock:
            socks, self._open, self._idle = list(self._open), set(), {}
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
