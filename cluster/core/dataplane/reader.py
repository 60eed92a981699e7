"""The reading side of the TCP data plane: requests to every owner first, then the pages.

    for each owner:  send READ(keys)               (all owners start sending at once)
    for each owner:  header, pages scattered into their destinations, ACK, verdict

A large read is split into LANES runs of pages on as many pooled connections, received in
parallel threads (socket receives release the GIL): one TCP stream is bound by the one core
that copies it out of the kernel.

The verdict is how many leading pages kept their slot generation while they were sent; only
those count. Any failure (refused connection, a peer that closes or stalls past the deadline,
a malformed frame) makes that owner's pages a miss, closes its connection, and never raises.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cluster.core import cpu_sets
from cluster.core.dataplane import wire
from cluster.core.dataplane.connections import ConnectionPool
from cluster.core.dataplane.endpoint import PageRead
from cluster.core.dataplane.streams import recv_scatter

log = logging.getLogger("raykv.dataplane")
LANES = 2
LANE_MIN_BYTES = 8 << 20
_threads: ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def read_pages(pool: ConnectionPool, reads: list[PageRead],
               timeout_s: float) -> list[int | None]:
    """Per read, how many leading pages arrived intact (0: the owner holds none of them), or
    None when the exchange failed (the owner is unreachable, died or stalled)."""
    deadline_s = time.monotonic() + timeout_s
    lanes = [_lanes(read) for read in reads]
    parts = [part for read_lanes in lanes for part in read_lanes]
    started = [_start(pool, part, timeout_s) for part in parts]

    def finish(index: int) -> int | None:
        part, sock = parts[index], started[index]
        if sock is None:
            return 0 if not part.keys else None
        return _finish(pool, part, sock, deadline_s)

    others = [_lane_threads().submit(finish, i) for i in range(1, len(parts))]
    counts = [finish(0)] + [future.result() for future in others] if parts else []
    results, position = [], 0
    for read_lanes in lanes:
        results.append(_joined(read_lanes, counts[position : position + len(read_lanes)]))
        position += len(read_lanes)
    return results


def _lanes(read: PageRead) -> list[PageRead]:
    """The read as LANES runs of pages when it is large enough, else as itself."""
    num_lanes = min(LANES, len(read.keys))
    if num_lanes < 2 or len(read.keys) * read.geometry.page_bytes < LANE_MIN_BYTES:
        return [read]
    bounds = [len(read.keys) * lane // num_lanes for lane in range(num_lanes + 1)]
    return [PageRead(read.endpoint, read.geometry, read.keys[start:stop],
                     read.dests[start:stop], read.authority)
            for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]


def _joined(lanes: list[PageRead], counts: list[int | None]) -> int | None:
    """A read's leading pages from its lanes' counts: a lane counts only if every lane
    before it arrived whole."""
    total = 0
    for lane, count in zip(lanes, counts, strict=True):
        if count is None:
            return total or None
        total += count
        if count < len(lane.keys):
            break
    return total


def _lane_threads() -> ThreadPoolExecutor:
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = cpu_sets.thread_pool(2 * LANES, "raykv-lane")
        return _threads


def _start(pool: ConnectionPool, read: PageRead, timeout_s: float) -> socket.socket | None:
    if not read.keys:
        return None
    if read.authority is None:
        log.warning("data plane read of %d pages skipped: this reader holds no credential "
                    "(connect() gets it)", len(read.keys))
        return None
    sock = None
    try:
        sock = pool.take(read.endpoint, read.authority.peer_key, timeout_s)
        request = wire.ReadRequest(read.geometry, read.keys)
        sock.sendall(wire.encode_request(request, read.authority, pool.session(sock)))
        return sock
    except (OSError, KeyError) as error:  # KeyError: the pool was closed under us
        _failed(pool, read, sock, error)
        return None


def _finish(pool: ConnectionPool, read: PageRead, sock: socket.socket,
            deadline_s: float) -> int | None:
    try:
        status, num_pages, page_bytes = wire.REPLY.unpack(wire.recv_exact(sock, wire.REPLY.size))
        if status == wire.STATUS_REFUSED:
            log.warning("the page server %s:%d refused a read in namespace %r (its MAC)",
                        read.endpoint.host, read.endpoint.port, read.authority.namespace)
        if status != wire.STATUS_OK or num_pages == 0:
            pool.give(read.endpoint, read.authority.peer_key, sock)
            return 0
        if num_pages > len(read.keys) or page_bytes != read.geometry.page_bytes:
            raise wire.PeerGone(f"bad reply: {num_pages} pages of {page_bytes} bytes")
        for index in range(num_pages):
            recv_scatter(sock, list(read.dests[index]), deadline_s)
        sock.sendall(wire.ACK)
        (good,) = wire.VERDICT.unpack(wire.recv_exact(sock, wire.VERDICT.size))
        pool.give(read.endpoint, read.authority.peer_key, sock)
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
