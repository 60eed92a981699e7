"""Socket settings and the two loops that move page bytes: gather-send, scatter-receive.

Sockets stay in blocking mode, with the kernel's SO_RCVTIMEO / SO_SNDTIMEO as the bound on
each wait: Python's own timeouts make a socket non-blocking, and then MSG_WAITALL returns
whatever has arrived, so a 4 MiB page scattered over 512 runs would take hundreds of calls.
A wait past the bound raises BlockingIOError (an OSError), which callers treat as a miss.
"""

from __future__ import annotations

import socket
import struct
import time

IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg


def configure(sock: socket.socket, timeout_s: float) -> None:
    """No Nagle delay on the small frames, keepalive for silent peers, bounded waits."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    set_wait_s(sock, timeout_s)


def set_wait_s(sock: socket.socket, timeout_s: float) -> None:
    """The longest one send or receive may wait for progress."""
    seconds = int(timeout_s)
    timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_scatter(sock: socket.socket, buffers: list[memoryview], deadline_s: float) -> None:
    """Fill every buffer, in order, from the stream; PeerGone-like ConnectionError when the
    peer closes, TimeoutError past the deadline (time.monotonic())."""
    index, offset = 0, 0
    while index < len(buffers):
        if time.monotonic() > deadline_s:
            raise TimeoutError("page transfer past its deadline")
        batch = buffers[index : index + IOV_MAX]
        if offset:
            batch[0] = batch[0][offset:]
        wanted = sum(map(len, batch))
        count = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if count == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        if count == wanted:
            index, offset = index + len(batch), 0
            continue
        index, offset = _advance(buffers, index, offset, count)


def _advance(buffers: list[memoryview], index: int, offset: int, count: int) -> tuple[int, int]:
    """Where the stream stands after `count` more bytes from buffers[index][offset:]."""
    while count:
        left = len(buffers[index]) - offset
        if count < left:
            return index, offset + count
        count -= left
        index, offset = index + 1, 0
    return index, offset


def send_gather(sock: socket.socket, buffers: list, deadline_s: float) -> None:
    """Send every buffer, in order (sendall per buffer: one copy into the socket)."""
    for buffer in buffers:
        if time.monotonic() > deadline_s:
            raise TimeoutError("page transfer past its deadline")
        sock.sendall(buffer)
