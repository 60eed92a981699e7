"""Raw TCP streams between two processes: the floor a cross-node read is measured against.

raykv's TCP reader splits a large read into lanes, runs of pages on as many connections,
received in parallel threads (cluster/core/dataplane/reader.py). The raw stream does the same
with no raykv protocol: the same number of connections, the same split and the same threads.

    server (on A)   a thread per connection; a request (first page, number of pages) is
                    answered with sendall of those pages from process memory
    reader (on B)   one connection per lane; every lane's request goes out first, then lane 0
                    is received on the calling thread and every other lane on a thread of its
                    own, with the data plane's receive routine (streams.recv_scatter:
                    recvmsg_into the page's buffers, MSG_WAITALL)
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cluster.core.dataplane.endpoint import PageRead
from cluster.core.dataplane.reader import _lanes
from cluster.core.dataplane.streams import recv_scatter
from cluster.core.geometry import PageGeometry

REQUEST = struct.Struct("!II")  # first page, number of pages
READ_TIMEOUT_S = 60.0


def raykv_lanes(geometry: PageGeometry, num_pages: int) -> int:
    """How many lanes (connections) raykv's TCP reader uses for one read of num_pages pages
    from one owner: asked of the reader's own split, not restated here."""
    read = PageRead(None, geometry, (b"",) * num_pages, (None,) * num_pages, None)
    return len(_lanes(read))


def lane_bounds(num_pages: int, num_lanes: int) -> list[tuple[int, int]]:
    """[first, stop) pages of each lane: the reader's split (equal runs, the last the rest)."""
    bounds = [num_pages * lane // num_lanes for lane in range(num_lanes + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class StreamServer:
    """Streams runs of `pages` (num_pages x page_bytes, uint8) to every reader that asks."""

    def __init__(self, host: str, pages: np.ndarray):
        self.pages = pages
        self.listener = socket.create_server((host, 0))
        self.address = self.listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            while len(request := sock.recv(REQUEST.size, socket.MSG_WAITALL)) == REQUEST.size:
                first, count = REQUEST.unpack(request)
                for page in self.pages[first : first + count]:
                    sock.sendall(page)

    def close(self) -> None:
        self.listener.close()


class StreamReader:
    """num_lanes connections to a StreamServer, reused for every timed read."""

    def __init__(self, address: tuple[str, int], num_lanes: int):
        self.socks = [socket.create_connection(address) for _ in range(num_lanes)]
        for sock in self.socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.threads = ThreadPoolExecutor(max(1, num_lanes - 1), thread_name_prefix="raw-lane")

    def read_s(self, dests: Sequence[Sequence[memoryview]]) -> float:
        """Seconds to receive every page, page i into its buffers dests[i], in order."""
        lanes = list(zip(self.socks, lane_bounds(len(dests), len(self.socks)), strict=True))
        deadline_s = time.monotonic() + READ_TIMEOUT_S
        start_s = time.perf_counter()
        for sock, (first, stop) in lanes:
            sock.sendall(REQUEST.pack(first, stop - first))
        others = [self.threads.submit(_receive, sock, dests[first:stop], deadline_s)
                  for sock, (first, stop) in lanes[1:]]
        sock, (first, stop) = lanes[0]
        _receive(sock, dests[first:stop], deadline_s)
        for future in others:
            future.result()
        return time.perf_counter() - start_s

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.threads.shutdown()


def _receive(sock: socket.socket, dests: Sequence[Sequence[memoryview]],
             deadline_s: float) -> None:
    for buffers in dests:
        recv_scatter(sock, list(buffers), deadline_s)
