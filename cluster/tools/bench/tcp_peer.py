"""Raw TCP streams between two processes, the floor a cross-node get is measured against.

    server (on A)   a thread per connection; per request byte:
                    b"m"  sendall of each page from process memory   (the raw TCP stream)
                    b"s"  os.sendfile of each page from a /dev/shm file holding the same
                          bytes (a candidate transport: zero copy on the sending side)
    reader (on B)   recv_into a touched contiguous buffer, page by page (MSG_WAITALL); or
                    recvmsg_into a KV tensor's rows, page by page: the layout raykv's get
                    fills (512 runs per page here), without any raykv code
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time

import numpy as np

OPS = (b"m", b"s")


class StreamServer:
    """Streams `pages` (num_pages x page_bytes, uint8) to every reader that asks."""

    def __init__(self, host: str, pages: np.ndarray):
        self.pages = pages
        # Unnamed (unlinked at once): nothing is left in /dev/shm when the actor is killed.
        self.file = tempfile.TemporaryFile(dir="/dev/shm", prefix="raykv-bench-tcp-")
        self.file.write(pages.tobytes())
        self.file.flush()
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
            while (op := sock.recv(1)) in OPS:
                if op == b"m":
                    for page in self.pages:
                        sock.sendall(page)
                else:
                    self._sendfile(sock)

    def _sendfile(self, sock: socket.socket) -> None:
        page_bytes = self.pages.shape[1]
        for index in range(self.pages.shape[0]):
            offset, left = index * page_bytes, page_bytes
            while left:
                sent = os.sendfile(sock.fileno(), self.file.fileno(), offset, left)
                offset, left = offset + sent, left - sent

    def close(self) -> None:
        self.listener.close()
        self.file.close()


class StreamReader:
    """One connection to a StreamServer, reused for every timed read."""

    def __init__(self, address: tuple[str, int]):
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read_s(self, op: bytes, out: np.ndarray) -> float:
        """Seconds to receive every page into `out` (num_pages x page_bytes, touched)."""
        start_s = time.perf_counter()
        self.sock.sendall(op)
        for page in out:
            view, got = memoryview(page), 0
            while got < len(view):
                count = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
                if count == 0:
                    raise ConnectionError("the stream server closed the connection")
                got += count
        return time.perf_counter() - start_s

    def read_rows_s(self, out_rows: list[list[memoryview]]) -> float:
        """The same raw stream (b"m") scattered into a KV tensor's rows, page by page:
        out_rows[i] are page i's buffers (what raykv's reader fills; no raykv code)."""
        start_s = time.perf_counter()
        self.sock.sendall(b"m")
        for buffers in out_rows:
            index, offset = 0, 0
            while index < len(buffers):
                batch = buffers[index : index + 1024]
                if offset:
                    batch[0] = batch[0][offset:]
                count = self.sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
                if count == 0:
                    raise ConnectionError("the stream server closed the connection")
                index, offset = _advance(buffers, index, offset, count)
        return time.perf_counter() - start_s

    def close(self) -> None:
        self.sock.close()


def _advance(buffers: list[memoryview], index: int, offset: int, count: int) -> tuple[int, int]:
    while count:
        left = len(buffers[index]) - offset
        if count < left:
            return index, offset + count
        count -= left
        index, offset = index + 1, 0
    return index, offset
