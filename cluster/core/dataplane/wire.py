"""The data plane's frames: fixed little-endian structs, then raw page bytes.

    request   magic "RKV1" | op u8 | shape 5 x u32 | dtype 16 bytes | num_keys u32 | keys
    reply     status u8 | num_pages u32 | page_bytes u64 | num_pages x page_bytes
    ack       one byte (the reader holds every page)
    verdict   num_good u32 (the leading pages whose slots kept their generation)
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from cluster.core.geometry import PageGeometry
from cluster.core.keys import KEY_BYTES, PageKey

MAGIC = b"RKV1"
OP_READ = 1
OP_PUSH = 2  # the same request, answered by a NIXL write into the reader's buffer
STATUS_OK, STATUS_REFUSED = 0, 1
ACK = b"A"
MAX_KEYS = 1 << 16

REQUEST = struct.Struct("<4sB5I16sI")
REPLY = struct.Struct("<BIQ")
VERDICT = struct.Struct("<I")


class PeerGone(ConnectionError):
    """The other side closed the connection or sent something that is not a frame."""

    def __init__(self, message: str, received_bytes: int = -1):
        super().__init__(message)
        self.received_bytes = received_bytes


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """Pages of one geometry, by key, in chain order; `op` says how they travel back."""

    geometry: PageGeometry
    keys: tuple[PageKey, ...]
    op: int = OP_READ


def encode_request(request: ReadRequest) -> bytes:
    dtype = request.geometry.dtype.encode()
    assert len(dtype) <= 16, f"dtype name too long: {request.geometry.dtype}"
    head = REQUEST.pack(MAGIC, request.op, *request.geometry.shape, dtype, len(request.keys))
    return head + b"".join(request.keys)


def read_request(sock: socket.socket) -> ReadRequest | None:
    """The next request on `sock`; None when the peer closed it cleanly before one."""
    try:
        head = recv_exact(sock, REQUEST.size)
    except PeerGone as gone:
        if gone.received_bytes == 0:
            return None  # closed between requests: the normal end of a pooled connection
        raise
    magic, op, *rest = REQUEST.unpack(head)
    shape, dtype, num_keys = tuple(rest[:5]), rest[5].rstrip(b"\0").decode(), rest[6]
    if magic != MAGIC or op not in (OP_READ, OP_PUSH) or num_keys > MAX_KEYS:
        raise PeerGone(f"not a raykv request (magic {magic!r}, op {op}, {num_keys} keys)")
    blob = recv_exact(sock, num_keys * KEY_BYTES)
    keys = tuple(PageKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES))
    return ReadRequest(PageGeometry(shape, dtype), keys, op)


def recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    """Exactly num_bytes, or PeerGone (with how many had arrived) when the peer closed."""
    buffer = bytearray(num_bytes)
    view, got = memoryview(buffer), 0
    while got < num_bytes:
        count = sock.recv_into(view[got:], num_bytes - got)
        if count == 0:
            raise PeerGone(f"connection closed after {got} of {num_bytes} bytes", got)
        got += count
    return bytes(buffer)
