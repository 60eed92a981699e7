"""The NIXL transport: the TCP page server stays the (authenticated) control path, and the
pages' bytes move by a NIXL write (UCX: RDMA, shared memory or TCP, whichever it finds).

    reader                                         owner (NixlPageServer, a PageServer)
    connect (pooled; the server's auth, as TCP)
    PUSH request (keys; the request's own checks)
      + offer: its agent's metadata, a staging
        buffer (address, length)     ---------->   pins the longest held prefix (its namespace)
                                                   registers those pages, NIXL WRITE into the
                                                   staging buffer, waits, deregisters them
                                     <----------   reply(num_pages) + verdict (generations
                                                   checked after the write; then unpinned)
    copies the good pages out of staging into its destinations

The owner's memory is never exposed: it hands out no descriptor and no remote key, only the
bytes a request was given. A reader exposes just its staging buffers, and only to owners it
sent a request to. A PUSH passes the same checks as a READ (the connection's handshake, the
request's MAC, only its namespace's pages); a refused one is answered REFUSED, nothing
written. Anything NIXL-specific that fails (no NIXL here, an owner whose write failed: reply
PUSH_FAILED) sends the same pages over TCP on the same server; a peer that is gone or stalls
is a miss, as with TCP. See docs/dataplane.md ("NIXL").
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cluster.core.dataplane import wire
from cluster.core.dataplane.connections import ConnectionPool, close_shared_pool, shared_pool
from cluster.core.dataplane.endpoint import PageRead
from cluster.core.dataplane.nixl_agent import (
    STAGING_BYTES,
    NixlAgent,
    Offer,
    Staging,
    shared_agent,
    start_agent,
)
from cluster.core.dataplane.reader import _joined, _lanes, read_pages
from cluster.core.dataplane.server import Listen, PageServer, PageSource, ServedPages

log = logging.getLogger("raykv.dataplane")
NAME = "nixl"
OFFER = struct.Struct("<4sQQI")  # magic, staging address, its length, metadata length
OFFER_MAGIC = b"RKNX"
STATUS_PUSHED = 2  # the pages were written; a verdict follows (a TCP server never says it)
STATUS_PUSH_FAILED = 3  # the NIXL write failed: the reader reads the same pages over TCP
MAX_METADATA_BYTES = 1 << 20
PROGRESS_TICK_MS = 1  # while a reader waits for a reply, it progresses its NIXL this often
AGENT_START_S = 60.0  # a server waits this long for NIXL to start (a probe, then the agent)
_threads: ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def encode_offer(offer: Offer) -> bytes:
    head = OFFER.pack(OFFER_MAGIC, offer.address, offer.length_bytes, len(offer.metadata))
    return head + offer.metadata


def read_offer(sock: socket.socket) -> Offer:
    """The offer after a PUSH request; PeerGone when it is not one."""
    magic, address, length_bytes, metadata_bytes = OFFER.unpack(
        wire.recv_exact(sock, OFFER.size))
    if magic != OFFER_MAGIC or metadata_bytes > MAX_METADATA_BYTES:
        raise wire.PeerGone(f"not a NIXL offer (magic {magic!r}, {metadata_bytes} bytes)")
    return Offer(wire.recv_exact(sock, metadata_bytes), address, length_bytes)


class NixlPageServer(PageServer):
    """A PageServer that also answers PUSH requests with a NIXL write (readers without NIXL
    keep sending READ requests, answered over TCP as ever). A PUSH passes the same gates as a
    READ: the connection's handshake and per-peer limits (PageServer's), the request's tag
    (guard.permits), and only the pages of its namespace (source.open)."""

    def __init__(self, source: PageSource, listen: Listen, timeout_s: float, epoch: int,
                 agent: NixlAgent):
        super().__init__(source, listen, timeout_s, epoch)
        self.agent = agent
        self.endpoint = dataclasses.replace(self.endpoint, transport=NAME)
        self.counters.update({"pushed_pages": 0, "refused_pushes": 0})

    def stats(self) -> dict:
        return {**super().stats(), "transport": NAME, "nixl": dict(self.agent.counters)}

    def _serve_read(self, sock: socket.socket, request: wire.ReadRequest) -> None:
        if request.op != wire.OP_PUSH:
            super()._serve_read(sock, request)
            return
        offer = read_offer(sock)  # read even when refused: the stream stays in step
        self.counters["requests"] += 1
        page_bytes = request.geometry.page_bytes
        claim = dataclasses.replace(request.claim,  # the tag covers the offer too
                                    signed=request.claim.signed + encode_offer(offer))
        if not self.guard.permits(claim):  # nothing is pinned, nothing is written
            self.counters["refused_requests"] += 1
            sock.sendall(wire.REPLY.pack(wire.STATUS_REFUSED, 0, page_bytes))
            return
        served = self.source.open(request)
        if served is None:
            sock.sendall(wire.REPLY.pack(wire.STATUS_OK, 0, page_bytes))
            return
        try:
            self._push(sock, offer, served, page_bytes)
        finally:
            self.source.close(served)

    def _push(self, sock: socket.socket, offer: Offer, served: ServedPages,
              page_bytes: int) -> None:
        # Half the timeout: the reader still waits for our PUSH_FAILED, and reads over TCP.
        deadline_s = time.monotonic() + self.timeout_s / 2
        try:
            self.agent.push(offer, list(served.pages), deadline_s)
        except Exception as error:  # NIXL's own errors are not OSErrors
            log.warning("NIXL write of %d pages failed, the reader goes TCP: %s",
                        len(served.pages), error)
            self.counters["refused_pushes"] += 1
            sock.sendall(wire.REPLY.pack(STATUS_PUSH_FAILED, 0, page_bytes))
            return
        good = self.source.verify(served)
        self.counters["pushed_pages"] += good
        self.counters["served_pages"] += good
        self.counters["served_bytes"] += good * page_bytes
        self.counters["torn_pages"] += len(served.pages) - good
        sock.sendall(wire.REPLY.pack(STATUS_PUSHED, len(served.pages), page_bytes)
                     + wire.VERDICT.pack(good))


class NixlTransport:
    """Pages over NIXL where both ends have it, else over TCP (the same page servers)."""

    name = NAME

    def __init__(self) -> None:
        start_agent()  # in the background: reads go over TCP until the agent is up

    def serve(self, source: PageSource, listen: Listen, timeout_s: float,
              epoch: int) -> PageServer:
        agent = shared_agent(wait_s=AGENT_START_S)
        if agent is None:  # logged once by shared_agent: this node serves TCP only
            return PageServer(source, listen, timeout_s, epoch)
        return NixlPageServer(source, listen, timeout_s, epoch, agent)

    def read(self, reads: list[PageRead], timeout_s: float) -> list[int | None]:
        return read_nixl(shared_pool(), shared_agent(), reads, timeout_s)

    def close(self) -> None:
        close_shared_pool()
        agent = shared_agent()
        if agent is not None:
            agent.close()


# ---- the reading side -------------------------------------------------------------------


@dataclasses.dataclass
class _Lane:
    """One lane of a read: its staging buffer and connection while it runs, and its count."""

    read: PageRead
    count: int | None = 0
    rest_over_tcp: bool = False
    staging: Staging | None = None
    sock: socket.socket | None = None


def read_nixl(pool: ConnectionPool, agent: NixlAgent | None, reads: list[PageRead],
              timeout_s: float) -> list[int | None]:
    """Per read, the leading pages that arrived intact (None: the owner could not be read).
    Owners without NIXL, or all of them when this process has none, are read over TCP.

    As over TCP, every lane's first request goes out before any reply is awaited, so all
    owners write at once; the lanes then finish in parallel threads."""
    if agent is None:
        return read_pages(pool, reads, timeout_s)
    deadline_s = time.monotonic() + timeout_s
    lanes = [[_Lane(part) for part in _lanes(read)] if _pushable(read) else None
             for read in reads]
    work = [lane for read_lanes in lanes if read_lanes for lane in read_lanes]
    for lane in work:
        _start(pool, agent, lane, deadline_s)
    over_tcp = [i for i, read_lanes in enumerate(lanes) if read_lanes is None]
    threads = _lane_threads()
    tcp = threads.submit(read_pages, pool, [reads[i] for i in over_tcp], timeout_s)
    futures = [threads.submit(_finish, pool, agent, lane, deadline_s) for lane in work[1:]]
    if work:
        _finish(pool, agent, work[0], deadline_s)
    for future in futures:
        future.result()
    by_tcp = dict(zip(over_tcp, tcp.result(), strict=True))
    return [by_tcp[i] if read_lanes is None
            else _joined([lane.read for lane in read_lanes], [lane.count for lane in read_lanes])
            for i, read_lanes in enumerate(lanes)]


def _pushable(read: PageRead) -> bool:
    """Over NIXL: an owner that advertises it, pages to ask for, and a credential to ask
    with (without one, read_pages logs it and the read is a miss without a connection)."""
    return read.endpoint.transport == NAME and len(read.keys) > 0 and read.authority is not None


def _start(pool: ConnectionPool, agent: NixlAgent, lane: _Lane, deadline_s: float) -> None:
    """A staging buffer, a connection and the first request; none free: the lane goes TCP."""
    read = lane.read
    page_bytes = read.geometry.page_bytes
    lane.staging = agent.staging.take(
        page_bytes * min(len(read.keys), _pages_per_round(page_bytes)))
    if lane.staging is None:
        lane.rest_over_tcp = True
        return
    try:  # the server's handshake, as over TCP (auth.py)
        lane.sock = pool.take(read.endpoint, read.authority.peer_key,
                              max(0.001, deadline_s - time.monotonic()))
    except OSError as error:  # no connection: nothing was asked, the buffer is clean
        _return_staging(agent, lane.staging, clean=True)
        lane.staging = None
        _failed(pool, agent, lane, error)
        return
    try:
        _request(pool, lane.sock, read, 0, lane.staging)
    except (OSError, KeyError) as error:  # KeyError: the pool was closed under us
        _failed(pool, agent, lane, error)


def _finish(pool: ConnectionPool, agent: NixlAgent, lane: _Lane, deadline_s: float) -> None:
    """The lane's rounds over NIXL, then over TCP what NIXL could not carry (no staging buffer
    free, a refused write), within the same deadline."""
    if lane.sock is not None:
        try:
            clean = _rounds(pool, lane, agent, deadline_s)
            pool.give(lane.read.endpoint, lane.read.authority.peer_key, lane.sock)
            _return_staging(agent, lane.staging, clean)
        except (OSError, KeyError) as error:  # PeerGone is an OSError; KeyError: pool closed
            _failed(pool, agent, lane, error)
    done, read = lane.count or 0, lane.read
    if not lane.rest_over_tcp or done >= len(read.keys):
        return
    rest = PageRead(read.endpoint, read.geometry, read.keys[done:], read.dests[done:],
                    read.authority)
    (more,) = read_pages(pool, [rest], max(0.0, deadline_s - time.monotonic()))
    agent.counters["tcp_fallback_pages"] += more or 0
    lane.count = done + more if more is not None else (done or None)


def _failed(pool: ConnectionPool, agent: NixlAgent, lane: _Lane,
            error: BaseException) -> None:
    """The owner is gone, stalled or misbehaved: the lane's pages not yet in are a miss."""
    read = lane.read
    log.warning("NIXL read of %d pages from %s:%d failed: %s", len(read.keys),
                read.endpoint.host, read.endpoint.port, error)
    if lane.sock is not None:
        pool.discard(lane.sock)
    pool.forget(read.endpoint)
    _return_staging(agent, lane.staging, clean=False)
    lane.sock = None
    lane.count = lane.count or None


def _pages_per_round(page_bytes: int) -> int:
    return max(1, STAGING_BYTES // page_bytes)


def _request(pool: ConnectionPool, sock: socket.socket, read: PageRead, start: int,
             staging: Staging) -> None:
    """Ask for the pages from `start` that the staging buffer holds, to be written there;
    MACed as a TCP read is (reader._start), for the connection's session."""
    per_round = staging.offer.length_bytes // read.geometry.page_bytes
    request = wire.ReadRequest(read.geometry, read.keys[start : start + per_round],
                               op=wire.OP_PUSH)
    offer = encode_offer(staging.offer)
    frame = wire.encode_request(request, read.authority, pool.session(sock), trailer=offer)
    sock.sendall(frame + offer)


def _await_reply(sock: socket.socket, agent: NixlAgent, deadline_s: float) -> None:
    """Progress this end's NIXL until the owner's reply is there (the owner's write needs
    it); TimeoutError past the deadline."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while not poller.poll(PROGRESS_TICK_MS):
        if time.monotonic() > deadline_s:
            raise TimeoutError("no reply from the owner within the deadline")
        agent.progress()


def _rounds(pool: ConnectionPool, lane: _Lane, agent: NixlAgent, deadline_s: float) -> bool:
    """Rounds of as many pages as the staging buffer holds (the first already asked for);
    False when a write failed (the rest goes over TCP, and the buffer may yet be written
    to). A refused request (its tag) ends the lane with what it has: nothing was written."""
    sock, read, staging = lane.sock, lane.read, lane.staging
    page_bytes = read.geometry.page_bytes
    per_round = staging.offer.length_bytes // page_bytes
    for start in range(0, len(read.keys), per_round):
        if start:
            _request(pool, sock, read, start, staging)
        wanted = min(per_round, len(read.keys) - start)
        _await_reply(sock, agent, deadline_s)
        status, num_pages, reply_page_bytes = wire.REPLY.unpack(
            wire.recv_exact(sock, wire.REPLY.size))
        if status == STATUS_PUSH_FAILED:
            lane.rest_over_tcp = True
            return False
        if status == wire.STATUS_REFUSED:
            log.warning("the page server %s:%d refused a push in namespace %r (its MAC)",
                        read.endpoint.host, read.endpoint.port, read.authority.namespace)
            return True
        if status == wire.STATUS_OK and num_pages == 0:
            return True  # the owner holds none of them
        if status != STATUS_PUSHED or reply_page_bytes != page_bytes \
                or not 0 < num_pages <= wanted:
            raise wire.PeerGone(f"bad reply: status {status}, {num_pages} pages of "
                                f"{reply_page_bytes} bytes")
        (good,) = wire.VERDICT.unpack(wire.recv_exact(sock, wire.VERDICT.size))
        good = min(good, num_pages)
        _copy_out(staging.view, read.dests[start : start + good], page_bytes)
        lane.count = (lane.count or 0) + good
        if good < wanted:
            return True
    return True


def _copy_out(staging: memoryview, dests, page_bytes: int) -> None:
    """Page i of staging into dests[i]'s buffers, in order (as a TCP read scatters it)."""
    for index in range(len(dests)):
        offset = index * page_bytes
        for buffer in dests[index]:
            end = offset + len(buffer)
            buffer[:] = staging[offset:end]
            offset = end


def _return_staging(agent: NixlAgent, staging: Staging | None, clean: bool) -> None:
    """A buffer goes back for reuse only after a clean exchange: after a refused or broken
    one, a write into it may still land, so it is never handed out again (kept, not freed)."""
    if staging is None:
        return
    if clean:
        agent.staging.give(staging)
    else:
        agent.staging.quarantine(staging)


def _lane_threads() -> ThreadPoolExecutor:
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = ThreadPoolExecutor(8, thread_name_prefix="raykv-nixl-lane")
        return _threads

