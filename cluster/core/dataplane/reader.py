"""The reading side of the TCP data plane: requests to every owner first, then the pages.

    for each owner:  send READ(keys)               (all owners start sending at once)
    for each owner:  header, pages scattered into their destinations, ACK, verdict

The verdict is how many leading pages kept their slot generation while they were sent; only
those count. Any failure (refused connection, a peer that closes or stalls past the deadline,
a malformed frame) makes that owner's pages a miss, closes its connection, and never raises.
"""

from __future__ import annotations

import logging
import socket
import time

from cluster.core.dataplane import wire
from cluster.core.dataplane.connections import ConnectionPool
from cluster.core.dataplane.endpoint import PageRead
from cluster.core.dataplane.streams import recv_scatter

log = logging.getLogger("raykv.dataplane")


def read_pages(pool: ConnectionPool, reads: list[PageRead],
               timeout_s: float) -> list[int | None]:
    """Per read, how many leading pages arrived intact (0: the owner holds none of them), or
    None when the exchange failed (the owner is unreachable, died or stalled)."""
    deadline_s = time.monotonic() + timeout_s
    started = [_start(pool, read, timeout_s) for read in reads]
    counts = []
    for read, sock in zip(reads, started, strict=True):
        counts.append(_finish(pool, read, sock, deadline_s) if sock is not None
                      else (0 if not read.keys else None))
    return counts


def _start(pool: ConnectionPool, read: PageRead, timeout_s: float) -> socket.socket | None:
    if not read.keys:
        return None
    sock = None
    try:
        sock = pool.take(read.endpoint, timeout_s)
        sock.sendall(wire.encode_request(wire.ReadRequest(read.geometry, read.keys)))
        return sock
    except OSError as error:
        _failed(pool, read, sock, error)
        return None


def _finish(pool: ConnectionPool, read: PageRead, sock: socket.socket,
            deadline_s: float) -> int | None:
    try:
        status, num_pages, page_bytes = wire.REPLY.unpack(wire.recv_exact(sock, wire.REPLY.size))
        if status != wire.STATUS_OK or num_pages == 0:
            pool.give(read.endpoint, sock)
            return 0
        if num_pages > len(read.keys) or page_bytes != read.geometry.page_bytes:
            raise wire.PeerGone(f"bad reply: {num_pages} pages of {page_bytes} bytes")
        for index in range(num_pages):
            recv_scatter(sock, list(read.dests[index]), deadline_s)
        sock.sendall(wire.ACK)
        (good,) = wire.VERDICT.unpack(wire.recv_exact(sock, wire.VERDICT.size))
        pool.give(read.endpoint, sock)
        return min(good, num_pages)
    except OSError as error:  # ConnectionError, TimeoutError and PeerGone are OSErrors
        _failed(pool, read, sock, error)
        return None


def _failed(pool: ConnectionPool, read: PageRead, sock: socket.socket | None,
            error: BaseException) -> None:
    log.warning("data plane read of %d pages from %s:%d failed: %s", len(read.keys),
                read.endpoint.host, read.endpoint.port, error)
    if sock is not None:
        pool.discard(sock)
    pool.forget(read.endpoint)
