"""NIXL's own cases, on real agents (UCX over shared memory and over TCP, on loopback): where
NIXL is missing, will not start, or a write fails, the same pages come over TCP, byte-exact;
the owner never exposes its memory (the reader never learns its metadata, and every page
registered for a write is deregistered before it is unpinned); a PUSH without the peer key's
handshake, or MACed with another namespace's key, pins and writes nothing; a plain TCP server
refuses a PUSH rather than answering it with bytes; and reads larger than a staging buffer go
in rounds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import cluster.core.dataplane.nixl_agent as nixl_agent
import cluster.core.dataplane.nixl_transport as nixl_transport
from cluster.core.dataplane import wire
from cluster.core.dataplane.auth import KIND_NAMESPACE, Authority, request_key
from cluster.core.dataplane.connections import ConnectionPool
from cluster.core.dataplane.endpoint import Endpoint, PageRead
from cluster.core.dataplane.nixl_agent import NixlError
from cluster.core.dataplane.nixl_transport import NixlPageServer, NixlTransport, read_nixl
from cluster.core.dataplane.server import PageServer
from tests.unit._wires import Wire
from tests.unit.test_dataplane import (
    AUTH,
    HOST,
    KEYS,
    PEER,
    DictSource,
    G,
    as_raw,
    kv_reads,
    listen,
)
from tests.waiting import wait_until

NIXL_WIRES = ("nixl-shm", "nixl-tcp")


@pytest.fixture(params=NIXL_WIRES)
def nixl(request) -> Wire:
    return Wire(request.param)


def exact(out: torch.Tensor, source: DictSource, num_pages: int) -> bool:
    return all(torch.equal(as_raw(out, p), source.pages[KEYS[p]]) for p in range(num_pages))


def test_pages_are_pushed_by_nixl_not_sent_on_the_socket(nixl):
    source = DictSource(6)
    server = nixl.serve(source, listen(), 2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, nixl.reader, kv_reads(server.endpoint, out, 6), 2.0) == [6]
        assert exact(out, source, 6)
        assert server.endpoint.transport == "nixl"
        assert server.counters["pushed_pages"] == 6 and server.counters["refused_pushes"] == 0
    finally:
        pool.close()
        server.close()


def test_without_nixl_here_a_reader_gets_the_pages_over_tcp(nixl):
    source = DictSource(6)
    server = nixl.serve(source, listen(), 2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, None, kv_reads(server.endpoint, out, 6), 2.0) == [6]
        assert exact(out, source, 6)
        assert server.counters["pushed_pages"] == 0 and server.counters["served_pages"] == 6
    finally:
        pool.close()
        server.close()


def test_a_failed_nixl_write_sends_the_same_pages_over_tcp(nixl, monkeypatch):
    def broken(offer, pages, deadline_s):
        raise NixlError("the NIC went away")

    source = DictSource(6)
    server = nixl.serve(source, listen(), 2.0)
    monkeypatch.setattr(server.agent, "push", broken)
    pool = ConnectionPool()
    quarantined = nixl.reader.counters["quarantined_buffers"]
    fallback = nixl.reader.counters["tcp_fallback_pages"]
    try:
        out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, nixl.reader, kv_reads(server.endpoint, out, 6), 2.0) == [6]
        assert exact(out, source, 6)
        assert server.counters["refused_pushes"] == 1 and server.counters["requests"] == 2
        assert nixl.reader.counters["tcp_fallback_pages"] - fallback == 6
        # The refused exchange's buffer is not reused: a write into it might still land.
        assert nixl.reader.counters["quarantined_buffers"] - quarantined == 1
        wait_until(lambda: source.open_pins == 0, 5, "the owner to unpin")
    finally:
        pool.close()
        server.close()


def test_the_owner_exposes_no_memory_of_its_own(nixl, monkeypatch):
    registered, deregistered = [], []
    api = nixl.owner.api
    register, deregister = api.register_memory, api.deregister_memory
    monkeypatch.setattr(api, "register_memory",
                        lambda *a: registered.append(a) or register(*a))
    monkeypatch.setattr(api, "deregister_memory",
                        lambda *a: deregistered.append(a) or deregister(*a))
    source = DictSource(6)
    server = nixl.serve(source, listen(), 2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
        for _ in range(3):
            assert read_nixl(pool, nixl.reader, kv_reads(server.endpoint, out, 6), 2.0) == [6]
        assert len(registered) == len(deregistered) == 3  # each write's pages, then gone
        # The reader never got the owner's metadata: it cannot address the owner's memory.
        assert not nixl.reader.api.check_remote_metadata(nixl.owner.name)
    finally:
        pool.close()
        server.close()


def test_a_plain_tcp_server_refuses_a_push_and_the_read_is_a_miss(nixl):
    source = DictSource(2)
    server = PageServer(source, listen(), 2.0)
    pool = ConnectionPool()
    try:
        endpoint = Endpoint("nixl", HOST, server.endpoint.port)  # a wrong advertisement
        out = torch.zeros(4, 2, 2, 16 * 2, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, nixl.reader, kv_reads(endpoint, out, 2), 2.0) == [None]
        assert torch.count_nonzero(out) == 0 and source.open_pins == 0
    finally:
        pool.close()
        server.close()


def push_frame(pool: ConnectionPool, sock, authority: Authority, offer,
               sent_offer=None) -> bytes:
    """A PUSH MACed over `offer`; `sent_offer` (default: the same) is what goes on the wire."""
    request = wire.ReadRequest(G, KEYS[:4], op=wire.OP_PUSH)
    signed = nixl_transport.encode_offer(offer)
    sent = signed if sent_offer is None else nixl_transport.encode_offer(sent_offer)
    return wire.encode_request(request, authority, pool.session(sock), trailer=signed) + sent


def test_a_push_whose_offer_was_changed_on_the_way_writes_nothing(nixl):
    """Someone on the path swaps the offer after a tenant's MACed PUSH (another buffer, or
    another agent): the tag covers the offer, so the owner refuses and writes nowhere."""
    import dataclasses

    source = DictSource(6)
    server = nixl.serve(source, listen(), 2.0)
    staging = nixl.reader.staging.take(4 * G.page_bytes)
    staging.tensor.zero_()
    pool = ConnectionPool()
    try:
        sock = pool.take(server.endpoint, PEER, 2.0)
        elsewhere = dataclasses.replace(staging.offer, address=staging.offer.address + 4096)
        sock.sendall(push_frame(pool, sock, AUTH, staging.offer, sent_offer=elsewhere))
        status, num_pages, _ = wire.REPLY.unpack(wire.recv_exact(sock, wire.REPLY.size))
        assert (status, num_pages) == (wire.STATUS_REFUSED, 0)
        assert server.counters["refused_requests"] == 1 and source.open_pins == 0
        # The same request with its own offer is served.
        out = torch.zeros(4, 2, 2, 16 * 4, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, nixl.reader, kv_reads(server.endpoint, out, 4), 2.0) == [4]
        assert exact(out, source, 4)
    finally:
        nixl.reader.staging.give(staging)
        pool.close()
        server.close()


def test_a_push_without_the_credential_or_with_another_namespaces_mac_writes_nothing(nixl):
    """An attacker who knows the keys and offers a real staging buffer: on a raw socket (no
    handshake), or connected with the peer key but MACing for "tenant" with another
    namespace's key. Neither pins a page nor writes a byte into the buffer."""
    source = DictSource(6)
    opened = []
    open_pages = source.open
    source.open = lambda request: opened.append(request) or open_pages(request)
    server = nixl.serve(source, listen(), 2.0)
    staging = nixl.reader.staging.take(4 * G.page_bytes)
    staging.tensor.zero_()
    pool = ConnectionPool()
    try:
        raw = socket.create_connection(server.endpoint.address, timeout=2.0)
        forged = wire.ReadRequest(G, KEYS[:4], op=wire.OP_PUSH)
        raw.sendall(wire.encode_request(forged, AUTH, b"\0" * 32)
                    + nixl_transport.encode_offer(staging.offer))
        assert raw.recv(64) == b""  # closed by the handshake, not a byte back
        raw.close()
        other = Authority(PEER, KIND_NAMESPACE, "tenant", request_key(b"o" * 32))
        sock = pool.take(server.endpoint, PEER, 2.0)
        sock.sendall(push_frame(pool, sock, other, staging.offer))
        status, num_pages, _ = wire.REPLY.unpack(wire.recv_exact(sock, wire.REPLY.size))
        assert (status, num_pages) == (wire.STATUS_REFUSED, 0)
        for _ in range(100):  # anything in flight would land while the reader progresses
            nixl.reader.progress()
        assert torch.count_nonzero(staging.tensor) == 0
        assert not opened and server.counters["pushed_pages"] == 0
        assert server.counters["failed_handshakes"] >= 1
        assert server.counters["refused_requests"] == 1
        # Through the reader too: a miss, no fallback to TCP, its buffer clean for reuse.
        out = torch.zeros(4, 2, 2, 16 * 4, 32, dtype=torch.bfloat16)
        reads = [PageRead(r.endpoint, r.geometry, r.keys, r.dests, other)
                 for r in kv_reads(server.endpoint, out, 4)]
        quarantined = nixl.reader.counters["quarantined_buffers"]
        assert read_nixl(pool, nixl.reader, reads, 2.0) == [0]
        assert torch.count_nonzero(out) == 0 and not opened
        assert server.counters["refused_requests"] == 2 and server.counters["requests"] == 2
        assert nixl.reader.counters["quarantined_buffers"] == quarantined
    finally:
        nixl.reader.staging.give(staging)
        pool.close()
        server.close()


def test_a_read_larger_than_a_staging_buffer_goes_in_rounds(nixl, monkeypatch):
    page_bytes = kv_reads(Endpoint("nixl", HOST, 1), torch.zeros(4, 2, 2, 16, 32), 1)[0]
    monkeypatch.setattr(nixl_transport, "STAGING_BYTES", 2 * page_bytes.geometry.page_bytes)
    monkeypatch.setattr(nixl_agent, "STAGING_BYTES", 2 * page_bytes.geometry.page_bytes)
    reader = nixl_agent.NixlAgent()  # its staging buffers are 2 pages long
    source = DictSource(5)
    server = nixl.serve(source, listen(), 2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, reader, kv_reads(server.endpoint, out, 6), 2.0) == [5]
        assert exact(out, source, 5)
        assert server.counters["requests"] == 3 and server.counters["pushed_pages"] == 5
    finally:
        pool.close()
        server.close()
        reader.close()


def test_a_nixl_transport_serves_tcp_where_nixl_cannot_start(monkeypatch):
    monkeypatch.setattr(nixl_transport, "shared_agent", lambda wait_s=0.0: None)
    source = DictSource(3)
    transport = NixlTransport()
    server = transport.serve(source, listen(), 2.0, 7)
    try:
        assert not isinstance(server, NixlPageServer) and server.endpoint.transport == "tcp"
        out = torch.zeros(4, 2, 2, 16 * 3, 32, dtype=torch.bfloat16)
        assert transport.read(kv_reads(server.endpoint, out, 3), 2.0) == [3]
        assert exact(out, source, 3)
    finally:
        transport.close()
        server.close()


BROKEN_UCX = textwrap.dedent("""
    import torch
    from cluster.core.dataplane import nixl_agent
    from cluster.core.dataplane.transport import make_transport
    from tests.unit.test_dataplane import KEYS, DictSource, as_raw, kv_reads, listen

    transport = make_transport("nixl")
    source = DictSource(3)
    server = transport.serve(source, listen(), 2.0, 0)
    out = torch.zeros(4, 2, 2, 16 * 3, 32, dtype=torch.bfloat16)
    count = transport.read(kv_reads(server.endpoint, out, 3), 2.0)
    exact = all(torch.equal(as_raw(out, p), source.pages[KEYS[p]]) for p in range(3))
    print("RESULT", server.endpoint.transport, count, exact, nixl_agent.unavailable_reason())
    transport.close()
    server.close()
""")


def test_a_nixl_that_will_not_start_here_leaves_the_pages_to_tcp():
    """A real NIXL whose UCX cannot start (UCX_TLS=shm offers no transport with peer-failure
    handling, which NIXL asks for), in a process of its own: serving and reading go TCP."""
    nixl_agent_api = pytest.importorskip("cluster.core.dataplane.nixl_agent")
    try:
        nixl_agent_api.load_api()
    except ImportError as error:
        pytest.skip(f"NIXL is not installed: {error}")
    env = {**os.environ, "UCX_TLS": "shm", "UCX_NET_DEVICES": "lo",
           "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", BROKEN_UCX], env=env, capture_output=True,
                          text=True, timeout=120)
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and result, done.stderr[-2000:]
    assert result[0].startswith("RESULT tcp [3] True ") and "NIXL_ERR_BACKEND" in result[0]


@pytest.mark.gpu
def test_vram_pages_are_pushed_from_the_gpu(nixl):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    source = DictSource(4)
    source.pages = {k: page.cuda() for k, page in source.pages.items()}
    server = nixl.serve(source, listen(), 2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16 * 4, 32, dtype=torch.bfloat16)
        assert read_nixl(pool, nixl.reader, kv_reads(server.endpoint, out, 4), 2.0) == [4]
        assert all(torch.equal(as_raw(out, p), source.pages[KEYS[p]].cpu()) for p in range(4))
    finally:
        pool.close()
        server.close()
