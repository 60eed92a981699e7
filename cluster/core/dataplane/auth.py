"""Who may read pages from a page server, and which pages: a peer credential, then a MAC on
every request.

    connect   reader -> HELLO "RKA1" | client nonce (16)
              server -> server nonce (16) | MAC(peer key, "server" | cn | sn)
              reader -> MAC(peer key, "reader" | cn | sn)     (after checking the server's)
              server -> "K" (accepted), or closes without a byte
    request   ... | namespace | tag = MAC(authority key, session | request head | namespace |
              keys), session = cn | sn, so a request cannot be replayed on another connection

The peer key (one per service, derived from the master secret) opens a connection; it is
held by the node actors and by clients, which get it from the controller over Ray. The
authority key of a request is either its namespace's request key (derived from the
namespace's secret, which only that namespace's clients and the node actors hold) or the
node key (node actors only: replication pulls pages of any namespace). The MACs are keyed
blake3: one pass over the key list (32 bytes a page), never over page bytes. Comparisons are
constant-time (hmac.compare_digest).
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3

MAC_BYTES = 32
NONCE_BYTES = 16
HELLO = struct.Struct(f"<4s{NONCE_BYTES}s")
CHALLENGE = struct.Struct(f"<{NONCE_BYTES}s{MAC_BYTES}s")
HELLO_MAGIC = b"RKA1"
ACCEPTED = b"K"
KIND_NAMESPACE, KIND_NODE = 1, 2
_PEER_CONTEXT = "raykv 2026 data plane peer key v1"
_NODE_CONTEXT = "raykv 2026 data plane node key v1"
_REQUEST_CONTEXT = "raykv 2026 data plane namespace request key v1"


class AuthFailed(ConnectionError):
    """The other side did not prove the peer key (or closed during the handshake)."""


def peer_key(master: bytes) -> bytes:
    """The service's connection credential (from its master secret)."""
    return blake3.blake3(master, derive_key_context=_PEER_CONTEXT).digest(MAC_BYTES)


def node_key(master: bytes) -> bytes:
    """The node actors' request authority over every namespace (replication)."""
    return blake3.blake3(master, derive_key_context=_NODE_CONTEXT).digest(MAC_BYTES)


def request_key(namespace_secret: bytes) -> bytes:
    """A namespace's request authority, from the namespace's key-chain secret."""
    return blake3.blake3(namespace_secret,
                         derive_key_context=_REQUEST_CONTEXT).digest(MAC_BYTES)


def mac(key: bytes, *parts: bytes) -> bytes:
    """Keyed blake3 over the parts, each length-prefixed (no two splits collide)."""
    hasher = blake3.blake3(key=key)
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.digest(MAC_BYTES)


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


@dataclass(frozen=True, slots=True)
class Authority:
    """What a reader proves: the peer key to connect, and the key its requests are MACed
    with, for `namespace` (KIND_NAMESPACE) or for any namespace (KIND_NODE, namespace "")."""

    # Keys stay out of repr: a traceback or log line that prints the object shows no secret.
    peer_key: bytes = field(repr=False)
    kind: int
    namespace: str
    key: bytes = field(repr=False)

    @staticmethod
    def of_namespace(peer: bytes, namespace: str, namespace_secret: bytes) -> Authority:
        return Authority(peer, KIND_NAMESPACE, namespace, request_key(namespace_secret))

    @staticmethod
    def of_node(peer: bytes, node: bytes, namespace: str = "") -> Authority:
        """A node actor's: pages of `namespace` only, or of any when it is ""."""
        return Authority(peer, KIND_NODE, namespace, node)

    def tag(self, session: bytes, signed: bytes) -> bytes:
        return mac(self.key, session, signed)


# ---- the handshake ---------------------------------------------------------------------------


def client_handshake(sock: socket.socket, peer: bytes) -> bytes:
    """Prove the peer key to a server and check its proof; the session (cn | sn).
    AuthFailed when the server's proof is wrong or it closes (it refused ours)."""
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HELLO.pack(HELLO_MAGIC, client_nonce))
    server_nonce, proof = CHALLENGE.unpack(_recv(sock, CHALLENGE.size))
    session = client_nonce + server_nonce
    if not same(proof, mac(peer, b"server", session)):
        raise AuthFailed("the page server did not prove the service's peer key")
    sock.sendall(mac(peer, b"reader", session))
    if _recv(sock, len(ACCEPTED)) != ACCEPTED:
        raise AuthFailed("the page server refused this reader's credential")
    return session


def server_handshake(sock: socket.socket, peer: bytes, deadline_s: float) -> bytes | None:
    """Check a reader's proof of the peer key by `deadline_s` (time.monotonic()); the
    session, or None (then close it). OSError when the reader stalls or closes."""
    magic, client_nonce = HELLO.unpack(_recv(sock, HELLO.size, deadline_s))
    if magic != HELLO_MAGIC:
        return None
    server_nonce = os.urandom(NONCE_BYTES)
    session = client_nonce + server_nonce
    sock.sendall(CHALLENGE.pack(server_nonce, mac(peer, b"server", session)))
    if not same(_recv(sock, MAC_BYTES, deadline_s), mac(peer, b"reader", session)):
        return None
    sock.sendall(ACCEPTED)
    return session


def _recv(sock: socket.socket, num_bytes: int, deadline_s: float | None = None) -> bytes:
    """num_bytes from sock; with a deadline, each receive waits only for the time left (a
    peer that sends a byte just inside each socket timeout is closed at the deadline, not
    at twice it). The socket's own timeout is restored after."""
    buffer, timeout_s = bytearray(), sock.gettimeout()
    try:
        while len(buffer) < num_bytes:
            if deadline_s is not None:
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError("the handshake ran past its deadline")
                sock.settimeout(left_s if timeout_s is None else min(left_s, timeout_s))
            chunk = sock.recv(num_bytes - len(buffer))
            if not chunk:
                raise AuthFailed(f"closed during the handshake after {len(buffer)} bytes")
            buffer += chunk
    finally:
        if deadline_s is not None:
            sock.settimeout(timeout_s)
    return bytes(buffer)


# ---- the server's check of a request ---------------------------------------------------------


UNKNOWN_RETRY_S = 5.0  # a namespace the controller did not know is asked about again after
MAX_UNKNOWN = 1024  # refused names remembered at most


def _now_s() -> float:
    return time.monotonic()


@dataclass(frozen=True, slots=True)
class Claim:
    """A request's authority as received: kind, namespace, tag, and what the tag covers."""

    kind: int
    namespace: str
    tag: bytes
    session: bytes
    signed: bytes


def verify(claim: Claim, key: bytes | None) -> bool:
    """Whether the claim's tag is right under `key` (None: no such authority here)."""
    if key is None:
        return False
    return same(claim.tag, mac(key, claim.session, claim.signed))


class Guard:
    """A page server's side: the peer key connections must prove, and the check of each
    request's tag. `namespace_secret(name)` gives a namespace's secret (None for one not
    registered); it is asked once per namespace (the node actor asks the controller), and
    about a name it did not know at most every UNKNOWN_RETRY_S."""

    def __init__(self, peer: bytes, node: bytes,
                 namespace_secret: Callable[[str], bytes | None]):
        self.peer_key = peer
        self._node_key = node
        self._namespace_secret = namespace_secret
        self._request_keys: dict[str, bytes] = {}
        self._unknown: dict[str, float] = {}  # name -> when it was refused (monotonic s)
        self._lock = threading.Lock()

    def permits(self, claim: Claim | None) -> bool:
        """Whether a request's tag proves its authority (constant-time compare)."""
        if claim is None:
            return False
        if claim.kind == KIND_NODE:
            return verify(claim, self._node_key)
        if claim.kind != KIND_NAMESPACE:
            return False
        return verify(claim, self._request_key(claim.namespace))

    def _request_key(self, namespace: str) -> bytes | None:
        now_s = _now_s()
        with self._lock:
            key = self._request_keys.get(namespace)
            refused_s = self._unknown.get(namespace)
        if key is not None:
            return key
        if refused_s is not None and now_s - refused_s < UNKNOWN_RETRY_S:
            return None  # asked lately: not a controller round trip per request
        secret = self._namespace_secret(namespace)
        if secret is None:
            with self._lock:
                if len(self._unknown) >= MAX_UNKNOWN:  # many names: forget them, stay bounded
                    self._unknown.clear()
                self._unknown[namespace] = now_s
            return None
        key = request_key(secret)
        with self._lock:
            self._request_keys[namespace] = key
        return key


@dataclass(frozen=True, slots=True)
class ClientSecrets:
    """What a client holds: its namespace's key-chain secret and the service's peer key
    (connect() gets both from the controller; b"" when unknown: its remote reads miss)."""

    namespace_secret: bytes = field(default=b"", repr=False)
    peer_key: bytes = field(default=b"", repr=False)

    def authority(self, namespace: str) -> Authority | None:
        """The client's authority for data-plane reads; None without a peer key."""
        if not self.peer_key or not self.namespace_secret:
            return None
        return Authority.of_namespace(self.peer_key, namespace, self.namespace_secret)
