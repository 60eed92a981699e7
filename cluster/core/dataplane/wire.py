"""The data plane's frames: fixed little-endian structs, then raw page bytes.

    request   magic "RKV2" | op u8 | shape 5 x u32 | dtype 16 bytes | num_keys u32 |
              kind u8 | namespace_len u8 | tag 32 bytes | namespace | keys
    reply     status u8 | num_pages u32 | page_bytes u64 | num_pages x page_bytes
    ack       one byte (the reader holds every page)
    verdict   num_good u32 (the leading pages whose slots kept their generation)

The tag is the request's MAC (auth.py): over the connection's session, the head (the tag
left out), the namespace, the keys and, for a PUSH, the NIXL offer that follows the frame.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from cluster.core.dataplane.auth import MAC_BYTES, Authority, Claim
from cluster.core.geometry import PageGeometry
from cluster.core.keys import KEY_BYTES, PageKey

MAGIC = b"RKV2"
OP_READ = 1
OP_PUSH = 2  # the same request, answered by a NIXL write into the reader's buffer
STATUS_OK, STATUS_REFUSED = 0, 1
ACK = b"A"
MAX_KEYS = 1 << 16
MAX_NAMESPACE_BYTES = 255
MAX_PAGE_BYTES = 1 << 40  # no page is a terabyte: a larger one is a malformed request

REQUEST = struct.Struct("<4sB5I16sIBB")
REPLY = struct.Struct("<BIQ")
VERDICT = struct.Struct("<I")


class PeerGone(ConnectionError):
    """The other side closed the connection or sent something that is not a frame."""

    def __init__(self, message: str, received_bytes: int = -1):
        super().__init__(message)
        self.received_bytes = received_bytes


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """Pages of one geometry, by key, in chain order; `claim` is the authority it came with
    (set by read_request; a reader's own requests carry none); `op` says how they travel back
    (OP_READ: on the connection; OP_PUSH: a NIXL write into the reader's buffer)."""

    geometry: PageGeometry
    keys: tuple[PageKey, ...]
    claim: Claim | None = None
    op: int = OP_READ


def encode_request(request: ReadRequest, authority: Authority, session: bytes,
                   trailer: bytes = b"") -> bytes:
    """The request frame, MACed for this connection's session under the authority's key.
    `trailer`, bytes the caller sends right after the frame (a PUSH's NIXL offer), is MACed
    with it, so no one on the way can change where the pages go."""
    dtype = request.geometry.dtype.encode()
    assert len(dtype) <= 16, f"dtype name too long: {request.geometry.dtype}"
    namespace = authority.namespace.encode()
    if len(namespace) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"namespace name over {MAX_NAMESPACE_BYTES} bytes")
    head = REQUEST.pack(MAGIC, request.op, *request.geometry.shape, dtype, len(request.keys),
                        authority.kind, len(namespace))
    keys = b"".join(request.keys)
    tag = authority.tag(session, head + namespace + keys + trailer)
    return head + tag + namespace + keys


def read_request(sock: socket.socket, session: bytes) -> ReadRequest | None:
    """The next request on `sock` (a connection of that session); None when the peer closed
    it cleanly before one."""
    try:
        head = recv_exact(sock, REQUEST.size)
    except PeerGone as gone:
        if gone.received_bytes == 0:
            return None  # closed between requests: the normal end of a pooled connection
        raise
    magic, op, *rest = REQUEST.unpack(head)
    shape, dtype, num_keys = tuple(rest[:5]), rest[5].rstrip(b"\0"), rest[6]
    kind, namespace_len = rest[7], rest[8]
    if magic != MAGIC or op not in (OP_READ, OP_PUSH) or num_keys > MAX_KEYS:
        raise PeerGone(f"not a raykv request (magic {magic!r}, op {op}, {num_keys} keys)")
    tag = recv_exact(sock, MAC_BYTES)
    namespace = recv_exact(sock, namespace_len)
    blob = recv_exact(sock, num_keys * KEY_BYTES)
    try:
        geometry = PageGeometry(shape, dtype.decode())
        geometry.validate()  # a known dtype, positive dims
        if geometry.page_bytes > MAX_PAGE_BYTES:  # the reply's u64, and any sane page
            raise ValueError(f"pages of {geometry.page_bytes} bytes")
        claim = Claim(kind, namespace.decode(), tag, session, head + namespace + blob)
    except (UnicodeDecodeError, ValueError, TypeError) as error:
        raise PeerGone(f"not a raykv request: {error}") from None
    keys = tuple(PageKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES))
    return ReadRequest(geometry, keys, claim, op)


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
