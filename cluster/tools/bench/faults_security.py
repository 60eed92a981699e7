"""The attacks of `raykv bench faults` on the data plane, made while the workload runs, from
the driver (a process on the pod network): raw sockets to every node actor's page server.

    unauthenticated_pages   for pages known to be held (a prompt of the default namespace put
                            just before): the old unauthenticated read frame, the read frame
                            without a handshake, a handshake with a guessed peer key; and
                            IDLE_FLOOD idle connections to each server for hold_s (the old
                            lockout)
    cross_tenant_pages      with the peer key and the secret of another namespace (a client
                            of that tenant is inside the cluster): its own MAC over the
                            victim's keys, the victim's namespace claimed with its own key,
                            and a node's authority claimed with its own key

Each attempt counts; a read is an attempt that got any page back (a reply with pages, or a
page's bytes anywhere in what came back). The same keys read with the right authority, just
before, is the control: without it (or without attempts) nothing was shown, and the ratio is
not exercised (null), a failure.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time

import ray

from actors.handles import ControllerHandle, NodeHandle
from cluster.core.dataplane import auth, wire
from cluster.core.geometry import PageGeometry
from cluster.tools.doomed_writer import known_kv

ATTEMPTS_PER_KIND = 5
IDLE_FLOOD = 300
ATTACK_WAIT_S = 3.0
CONTROL_TRIES = 3
VICTIM_TOKENS = [8_000_000 + i for i in range(64)]
INTRUDER = "intruder"


def _victim(ctx) -> tuple:
    """(geometry, keys, page bytes, the victim's own authority, endpoints of every node)."""
    from cluster import connect

    client = connect(ctx.spec)  # namespace "default": the victim
    kv = known_kv(ctx.spec, len(VICTIM_TOKENS), 515151)
    client.put(VICTIM_TOKENS, kv)
    geometry = PageGeometry.of(ctx.spec, ctx.config.page_tokens)
    step = ctx.config.page_tokens
    pages = [kv[:, :, :, p : p + step].contiguous().view(-1).numpy().tobytes()
             for p in range(0, kv.shape[3], step)]
    endpoints = []
    for node in ray.nodes():
        handle = NodeHandle.lookup(node["NodeID"], ctx.config) if node["Alive"] else None
        if handle is not None:
            with contextlib.suppress(Exception):
                endpoints.append(ray.get(handle.dataplane(), timeout=10))
    return geometry, tuple(client.keys(VICTIM_TOKENS)), pages, client.view.authority, endpoints


def _sent_back(endpoint, frame: bytes) -> bytes:
    """Send a frame on a fresh connection; everything the server sends until it closes."""
    got = b""
    with socket.create_connection(endpoint.address, timeout=ATTACK_WAIT_S) as sock:
        sock.sendall(frame)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 20):
                got += chunk
    return got


def _raw_frames(geometry: PageGeometry, keys: tuple) -> list[bytes]:
    head = struct.pack("<4sB5I16sI", b"RKV1", 1, *geometry.shape, geometry.dtype.encode(),
                       len(keys))
    guessed = auth.Authority.of_namespace(os.urandom(32), "default", os.urandom(32))
    new = wire.encode_request(wire.ReadRequest(geometry, keys), guessed, bytes(32))
    return [head + b"".join(keys), new,
            auth.HELLO.pack(auth.HELLO_MAGIC, os.urandom(16)) + os.urandom(32) + new]


def _credentialed_read(endpoint, geometry, keys, authority) -> int:
    """Pages a read with `authority` got back (a handshake, one request)."""
    with socket.create_connection(endpoint.address, timeout=ATTACK_WAIT_S) as sock:
        session = auth.client_handshake(sock, authority.peer_key)
        sock.sendall(wire.encode_request(wire.ReadRequest(geometry, keys), authority, session))
        _, num_pages, page_bytes = wire.REPLY.unpack(wire.recv_exact(sock, wire.REPLY.size))
        if num_pages:
            wire.recv_exact(sock, num_pages * page_bytes)
            sock.sendall(wire.ACK)
            wire.recv_exact(sock, wire.VERDICT.size)
        return num_pages


def _control(endpoints, geometry, keys, authority) -> int:
    """The victim's own read of its pages, at the best endpoint (the owner's), made before
    the attacks (a connection refused under load is tried again)."""
    best = 0
    for _ in range(CONTROL_TRIES):
        for endpoint in endpoints:
            with contextlib.suppress(OSError):
                best = max(best, _credentialed_read(endpoint, geometry, keys, authority))
        if best:
            return best
        time.sleep(0.5)
    return best


def _flood(endpoints, hold_s: float) -> int:
    """IDLE_FLOOD idle connections to every page server, held for hold_s (the workload's
    remote reads go on meanwhile)."""
    socks = []
    try:
        for endpoint in endpoints:
            for _ in range(IDLE_FLOOD):
                with contextlib.suppress(OSError):
                    socks.append(socket.create_connection(endpoint.address, timeout=1.0))
        time.sleep(hold_s)
    finally:
        for sock in socks:
            sock.close()
    return len(socks)


def unauthenticated_pages(ctx) -> dict:
    geometry, keys, pages, authority, endpoints = _victim(ctx)
    control_pages = _control(endpoints, geometry, keys, authority)
    attempts = reads = 0
    for endpoint in endpoints:
        for frame in _raw_frames(geometry, keys) * ATTEMPTS_PER_KIND:
            try:
                got = _sent_back(endpoint, frame)
            except OSError:
                got = b""
            attempts += 1
            reads += int(len(got) > auth.CHALLENGE.size
                         or any(page[:512] in got for page in pages))
    flooded = _flood(endpoints, ctx.hold_s)
    return {"attempts": attempts, "reads": reads, "idle_flood": flooded,
            "control_pages": control_pages}


def cross_tenant_pages(ctx) -> dict:
    from cluster import add_namespace

    geometry, keys, _, authority, endpoints = _victim(ctx)
    control_pages = _control(endpoints, geometry, keys, authority)
    with contextlib.suppress(ValueError):
        add_namespace(INTRUDER)
    controller = ControllerHandle.lookup(ctx.config)
    peer = ray.get(controller.peer_key(), timeout=10)
    own_secret = ray.get(controller.namespace_secret(INTRUDER), timeout=10)
    own_key = auth.request_key(own_secret)
    tries = [auth.Authority.of_namespace(peer, INTRUDER, own_secret),
             auth.Authority(peer, auth.KIND_NAMESPACE, "default", own_key),
             auth.Authority(peer, auth.KIND_NODE, "", own_key)]
    attempts = reads = 0
    for endpoint in endpoints:
        for attacker in tries * ATTEMPTS_PER_KIND:
            attempts += 1
            with contextlib.suppress(OSError):
                reads += int(_credentialed_read(endpoint, geometry, keys, attacker) > 0)
    return {"attempts": attempts, "reads": reads, "control_pages": control_pages}


def read_ratio(figures: dict) -> float | None:
    """Reads per attempt; None (not exercised: the benchmark fails) when nothing was attempted
    or the control read found no page (then the attempts showed nothing)."""
    if not figures.get("attempts") or not figures.get("control_pages"):
        return None
    return figures["reads"] / figures["attempts"]


KV_KINDS = ("put", "remote")
FAULTS = {"unauthenticated_pages": (unauthenticated_pages, KV_KINDS),
          "cross_tenant_pages": (cross_tenant_pages, KV_KINDS)}
RATIOS = {"unauthenticated_reads": "unauthenticated_pages",
          "cross_tenant_reads": "cross_tenant_pages"}
