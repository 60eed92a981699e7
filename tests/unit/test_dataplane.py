"""The data plane on real sockets, no Ray: pages cross byte-exact into a KV tensor's rows,
connections are reused and closed, the server listens on one socket on its address only, a
peer that dies or stalls mid-transfer is a miss (no hang, no wrong bytes counted), and a slot
that changes while it is sent is cut off by the verdict. Then the node's side: a NodeStore
served from an event loop in another thread, and a pull into another store's slots.

Each runs over every wire (tests/unit/_wires.py): TCP, and NIXL with UCX over shared memory
and over TCP. NIXL's own cases (fallbacks, what the owner exposes) are in
test_dataplane_nixl.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import psutil
import pytest
import torch

from cluster.core.dataplane import wire
from cluster.core.dataplane.auth import Authority, Guard, server_handshake
from cluster.core.dataplane.connections import ConnectionPool
from cluster.core.dataplane.endpoint import Endpoint, PageRead, TensorPages, tensor_buffers
from cluster.core.dataplane.pull import pull_pages
from cluster.core.dataplane.server import Listen, ServedPages
from cluster.core.dataplane.source import StoreSource
from cluster.core.dataplane.transport import TcpTransport, make_transport
from cluster.core.geometry import PageGeometry
from tests.unit._pages import GEOMETRY, key, page_bytes
from tests.unit._pool_harness import store_put
from tests.unit._wires import WIRES, Wire, WireTransport
from tests.waiting import wait_until

G = PageGeometry((4, 2, 2, 16, 32), "bfloat16")  # 16 KiB pages, 16 rows of 1 KiB in a KV
HOST = "127.0.0.1"
KEYS = tuple(bytes([i]) * 16 for i in range(8))
PEER, NODE, TENANT_SECRET = b"p" * 32, b"n" * 32, b"t" * 32
AUTH = Authority.of_namespace(PEER, "tenant", TENANT_SECRET)
NODE_AUTH = Authority.of_node(PEER, NODE)


def listen(first_port: int = 0) -> Listen:
    """Loopback, readers proving PEER; namespace "tenant" known."""
    return Listen(HOST, first_port, Guard(PEER, NODE, {"tenant": TENANT_SECRET}.get))


def raw_page(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (G.page_bytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(i))


class DictSource:
    """Pages by key; `good` caps the verdict (a slot changed while it was sent)."""

    def __init__(self, num_pages: int):
        self.pages = {KEYS[i]: raw_page(i) for i in range(num_pages)}
        self.good: int | None = None
        self.open_pins = 0

    def open(self, request):
        pages = []
        for k in request.keys:
            if k not in self.pages:
                break
            pages.append(self.pages[k])
        if not pages:
            return None
        self.open_pins += 1
        return ServedPages(tuple(pages), None)

    def verify(self, served) -> int:
        return len(served.pages) if self.good is None else self.good

    def close(self, served) -> None:
        self.open_pins -= 1


def kv_reads(endpoint: Endpoint, out: torch.Tensor, num_pages: int) -> list[PageRead]:
    pages = TensorPages(out, [out[:, :, :, p * 16 : (p + 1) * 16] for p in range(num_pages)])
    return [PageRead(endpoint, G, KEYS[:num_pages], pages, AUTH)]


def as_raw(out: torch.Tensor, p: int) -> torch.Tensor:
    return out[:, :, :, p * 16 : (p + 1) * 16].contiguous().view(-1).view(torch.uint8)


@pytest.fixture(params=WIRES)
def carrier(request) -> Wire:
    return Wire(request.param)


@pytest.fixture
def served(carrier):
    source = DictSource(6)
    server = carrier.serve(source, listen(), timeout_s=2.0)
    pool = ConnectionPool()
    yield source, server, pool
    pool.close()
    server.close()


def test_pages_land_byte_exact_in_the_rows_of_a_kv_tensor(served, carrier):
    source, server, pool = served
    out = torch.zeros(4, 2, 2, 16 * 8, 32, dtype=torch.bfloat16)
    assert carrier.read(pool, kv_reads(server.endpoint, out, 8), 2.0) == [6]  # it holds 6
    assert all(torch.equal(as_raw(out, p), source.pages[KEYS[p]]) for p in range(6))
    assert torch.count_nonzero(out[:, :, :, 6 * 16 :]) == 0
    assert server.counters["served_pages"] == 6
    wait_until(lambda: source.open_pins == 0, 5, "the server to unpin")


def test_connections_are_reused_then_closed(served, carrier):
    source, server, pool = served
    out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
    for _ in range(3):
        assert carrier.read(pool, kv_reads(server.endpoint, out, 6), 2.0) == [6]
    assert server.counters["accepted"] == 1 and pool.counters == {
        "connects": 1, "reuses": 2, "discards": 0}
    pool.close()
    wait_until(lambda: server.num_connections == 0, 5, "the server to see the close")
    server.close()
    with pytest.raises(OSError):
        socket.create_connection(server.endpoint.address, timeout=1.0)


def listening(pid: int) -> set[tuple[str, int]]:
    return {c.laddr[:2] for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_the_server_listens_on_one_socket_on_its_address_and_stops(carrier):
    before = listening(psutil.Process().pid)  # with NIXL's agents (and UCX's listeners) made
    server = carrier.serve(DictSource(1), listen(), timeout_s=1.0)
    assert listening(psutil.Process().pid) - before == {(HOST, server.endpoint.port)}
    server.close()
    assert listening(psutil.Process().pid) == before


def fake_owner(behaviour, kind: str = "tcp") -> tuple[Endpoint, threading.Thread]:
    """A server that reads one request and then does `behaviour(sock)`."""
    listener = socket.create_server((HOST, 0))
    endpoint = Endpoint(kind, HOST, listener.getsockname()[1])

    def serve():
        sock, _ = listener.accept()
        wire.read_request(sock, server_handshake(sock, PEER, time.monotonic() + 2.0))
        behaviour(sock)
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return endpoint, thread


def header(num_pages: int) -> bytes:
    return wire.REPLY.pack(wire.STATUS_OK, num_pages, G.page_bytes)


def dies_after_a_page_and_a_half(sock: socket.socket) -> None:
    sock.sendall(header(4) + bytes(raw_page(0).numpy()) + bytes(G.page_bytes // 2))
    sock.close()


def stalls_after_a_page(sock: socket.socket) -> None:
    sock.sendall(header(4) + bytes(raw_page(0).numpy()))
    time.sleep(3.0)
    sock.close()


def dies_before_its_verdict(sock: socket.socket) -> None:
    sock.close()  # a NIXL owner gone while (or before) it writes


def stalls_before_its_verdict(sock: socket.socket) -> None:
    time.sleep(3.0)  # a NIXL owner whose write never completes
    sock.close()


# Each wire's own failures: TCP's mid-stream, NIXL's before the verdict (the bytes move
# outside the socket, which carries only the request and the verdict).
FAILURES = [(name, behaviour) for name in WIRES for behaviour in (
    (dies_after_a_page_and_a_half, stalls_after_a_page) if name == "tcp"
    else (dies_before_its_verdict, stalls_before_its_verdict))]


@pytest.mark.parametrize(("carrier", "behaviour"), FAILURES, indirect=["carrier"])
def test_a_peer_that_dies_or_stalls_mid_transfer_is_a_miss_not_a_hang(carrier, behaviour):
    endpoint, thread = fake_owner(behaviour, carrier.endpoint_kind)
    pool = ConnectionPool()
    out = torch.zeros(4, 2, 2, 16 * 4, 32, dtype=torch.bfloat16)
    started_s = time.monotonic()
    assert carrier.read(pool, kv_reads(endpoint, out, 4), timeout_s=1.0) == [None]
    assert time.monotonic() - started_s < 2.5
    assert pool.num_open == 0  # a connection in an unknown state is never reused
    if carrier.name != "tcp":  # NIXL copies out of its staging only after a verdict
        assert torch.count_nonzero(out) == 0
    thread.join(5)


def test_a_refused_connection_is_a_miss(carrier):
    listener = socket.create_server((HOST, 0))
    endpoint = Endpoint(carrier.endpoint_kind, HOST, listener.getsockname()[1])
    listener.close()
    out = torch.zeros(4, 2, 2, 16, 32, dtype=torch.bfloat16)
    assert carrier.read(ConnectionPool(), kv_reads(endpoint, out, 1), 1.0) == [None]


def test_pages_whose_slots_changed_while_sent_are_cut_off(served, carrier):
    source, server, pool = served
    source.good = 2  # the third slot's generation moved before the reader had it
    out = torch.zeros(4, 2, 2, 16 * 6, 32, dtype=torch.bfloat16)
    assert carrier.read(pool, kv_reads(server.endpoint, out, 6), 2.0) == [2]
    assert server.counters["torn_pages"] == 4
    assert carrier.read(pool, kv_reads(server.endpoint, out, 6), 2.0) == [2]  # still in sync


def test_buffers_describe_the_rows_of_a_slice_and_refuse_what_does_not_flatten():
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    rows = tensor_buffers(x[:, :, 1:3])
    assert len(rows) == 6 and bytes(rows[1]) == x[0, 1, 1:3].contiguous().numpy().tobytes()
    assert len(tensor_buffers(x)) == 1
    assert tensor_buffers(x.transpose(0, 1)[:, :, 1:3]) is None  # rows at two strides
    assert tensor_buffers(x[:, :, :, ::2]) is None


def test_transports_are_named():
    from cluster.core.dataplane.nixl_transport import NixlTransport

    assert isinstance(make_transport("tcp"), TcpTransport)
    assert isinstance(make_transport("nixl"), NixlTransport)
    with pytest.raises(ValueError, match="known"):
        make_transport("carrier-pigeon")


# ---- the node's side: a NodeStore on its loop, and a pull into another store ----------------


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def on(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


def test_a_store_is_served_from_its_loop_and_pulled_into_another(stores, loop, carrier):
    owner, reader = stores.make(), stores.make(host_pages=4)
    on(loop, store_put(owner, [0, 1, 2]))
    server = carrier.serve(StoreSource(owner, loop, 2.0), listen(), 2.0)
    transport = WireTransport(carrier)
    try:
        keys = [key(0), key(1), key(2), key(9)]
        pulled = on(loop, pull_pages(reader, transport, server.endpoint,
                                     (GEOMETRY, keys, "tenant", NODE_AUTH), 2.0))
        assert pulled == 3
        pool = reader.pool(GEOMETRY)
        for i in range(3):
            entry = pool.index[key(i)]
            got = pool.memory[entry.tier].view(entry.slot)[: GEOMETRY.page_bytes]
            assert torch.equal(got, page_bytes(i)) and entry.namespace == "tenant"
        assert key(9) not in pool.index and not reader.reservations
        wait_until(lambda: not owner.leases, 5, "the owner to release its pins")
        assert on(loop, pull_pages(reader, transport, server.endpoint,
                                   (GEOMETRY, keys[:3], "", NODE_AUTH), 2.0)) == 0  # all held
    finally:
        transport.close()
        server.close()


def test_a_geometry_the_owner_never_held_is_a_miss(stores, loop, carrier):
    owner = stores.make()
    server = carrier.serve(StoreSource(owner, loop, 2.0), listen(), 2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16, 32, dtype=torch.bfloat16)
        assert carrier.read(pool, kv_reads(server.endpoint, out, 1), 2.0) == [0]
        assert not owner.pools  # no pool was created for a stranger's geometry
    finally:
        pool.close()
        server.close()


def test_a_large_read_is_split_over_two_connections_and_joined_in_order(monkeypatch, carrier):
    import cluster.core.dataplane.reader as reader

    monkeypatch.setattr(reader, "LANE_MIN_BYTES", 4 * G.page_bytes)
    source = DictSource(6)
    server = carrier.serve(source, listen(), timeout_s=2.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 16 * 8, 32, dtype=torch.bfloat16)
        assert carrier.read(pool, kv_reads(server.endpoint, out, 4), 2.0) == [4]
        assert server.counters["accepted"] == 2 and server.counters["requests"] == 2
        assert all(torch.equal(as_raw(out, p), source.pages[KEYS[p]]) for p in range(4))
        # Lane 2 asks for pages 4..7 of which the owner holds 4 and 5: 6 in all.
        assert carrier.read(pool, kv_reads(server.endpoint, out, 8), 2.0) == [6]
        del source.pages[KEYS[1]]  # a gap in lane 1: lane 2's pages do not count
        assert carrier.read(pool, kv_reads(server.endpoint, out, 8), 2.0) == [1]
    finally:
        pool.close()
        server.close()


def test_the_buffers_of_a_tensor_read_into_again_are_kept_with_it():
    out = torch.zeros(4, 2, 2, 32, 32, dtype=torch.bfloat16)
    first = TensorPages(out, [out[:, :, :, :16], out[:, :, :, 16:]])
    again = TensorPages(out, [out[:, :, :, 16:]])
    assert again[0] is first[1]  # made once
    other = torch.zeros_like(out)
    assert TensorPages(other, [other[:, :, :, 16:]])[0] is not first[1]
    first[0][0][:2] = b"\x01\x02"
    assert out.view(torch.uint8)[0, 0, 0, 0, :2].tolist() == [1, 2]
