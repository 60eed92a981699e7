"""A real node actor's page server, knocked on as an attacker on the pod network would, with
raw sockets on loopback: a read frame that names a page's key gets nothing without the
service's peer key, and nothing with another tenant's namespace MAC; the port is a fixed,
configured one. And the secrets stay out of Redis: after a start with Redis persistence, no
Redis key or value holds the master secret, a namespace secret or a data-plane key (every key
scanned, of every type), and an old master left there by an earlier raykv is deleted."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import ray
import redis

from actors.handles import ControllerHandle, NodeHandle
from cluster import CacheConfig, ModelSpec, add_namespace, connect, start, stop
from cluster.core import secrets
from cluster.core.dataplane import auth, wire
from cluster.core.geometry import PageGeometry
from cluster.tools.redis_server import RedisServer
from tests.kv import kv_for
from tests.waiting import wait_until

TINY = ModelSpec.preset("tiny-llama")
GEOMETRY = PageGeometry.of(TINY, 16)
TOKENS = list(range(2000, 2064))  # four pages
LOOPBACK = "127.0.0.3"


@pytest.fixture(scope="module")
def ray_loopback():
    """A local Ray whose node address is on loopback (Ray turns 127.0.0.1 itself into the
    machine's address; another of 127/8 it keeps): the page server listens there."""
    ray.init(address="local", num_cpus=2, resources={"kv_node": 1}, include_dashboard=False,
             object_store_memory=200 * 1024 * 1024, logging_level="WARNING",
             _node_ip_address=LOOPBACK)
    yield
    try:
        stop()
    finally:
        ray.shutdown()  # even when stop() raises: see tests/actors/conftest.py


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def service(ray_loopback, redis_server, tmp_path_factory):
    """raykv with Redis persistence, tenant-a's pages put; an old master planted in Redis
    where an earlier raykv kept it."""
    legacy = redis.Redis.from_url(redis_server.url)
    legacy.set("raykv:raykv:key-secret", b"L" * 32)
    legacy.close()
    disk_dir = str(tmp_path_factory.mktemp("page-auth"))
    config = CacheConfig(page_tokens=16, device_bytes=0, host_bytes=64 * 8192,
                         disk_bytes=1 << 20, disk_dir=disk_dir, redis_url=redis_server.url,
                         rebalance=False)
    start(config)
    add_namespace("tenant-a")
    add_namespace("tenant-b")
    owner = connect(TINY, "tenant-a")
    kv = kv_for(TINY, 64, 7)
    assert owner.put(TOKENS, kv) == 64
    node_id = ray.get_runtime_context().get_node_id()
    endpoint = ray.get(NodeHandle.lookup(node_id, config).dataplane())
    return {"config": config, "owner": owner, "endpoint": endpoint,
            "keys": owner.keys(TOKENS), "redis": redis_server}


def page_of(service, index: int) -> bytes:
    """The bytes of tenant-a's page `index`, read the legitimate way (shared memory)."""
    count, kv = service["owner"].get(TOKENS)
    assert count == 64
    return kv[:, :, :, index * 16 : (index + 1) * 16].contiguous().view(-1).numpy().tobytes()


def everything_sent(endpoint, frame: bytes, limit_s: float = 3.0) -> bytes:
    """Connect, send `frame`, and collect what the server sends until it closes."""
    got = b""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=limit_s) as sock:
        sock.sendall(frame)
        try:
            while chunk := sock.recv(1 << 20):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def old_read_frame(keys) -> bytes:
    """The read frame as it was (magic RKV1): geometry and keys, no credential at all."""
    head = struct.pack("<4sB5I16sI", b"RKV1", 1, *GEOMETRY.shape, GEOMETRY.dtype.encode(),
                       len(keys))
    return head + b"".join(keys)


def test_the_page_server_listens_on_the_configured_port_range(service):
    endpoint = service["endpoint"]
    assert endpoint.host == LOOPBACK
    assert 7460 <= endpoint.port < 7476 and service["config"].page_port == 7460


def test_a_read_without_the_credential_gets_no_page(service):
    endpoint, keys = service["endpoint"], service["keys"]
    page = page_of(service, 0)
    guessed_session = bytes(32)
    unauthenticated = wire.encode_request(
        wire.ReadRequest(GEOMETRY, tuple(keys)),
        auth.Authority.of_namespace(os.urandom(32), "tenant-a", os.urandom(32)),
        guessed_session)
    for frame in (old_read_frame(keys), unauthenticated,
                  auth.HELLO.pack(auth.HELLO_MAGIC, bytes(16)) + os.urandom(32)
                  + unauthenticated):
        sent = everything_sent(endpoint, frame)
        assert page[:256] not in sent and len(sent) <= auth.CHALLENGE.size


def test_a_read_with_another_tenants_namespace_gets_no_page(service):
    """tenant-b's client holds the peer key (it is in the cluster) and its own namespace's
    secret; asking for tenant-a's keys under either is refused."""
    config, endpoint, keys = service["config"], service["endpoint"], service["keys"]
    controller = ControllerHandle.lookup(config)
    peer = ray.get(controller.peer_key())
    b_secret = ray.get(controller.namespace_secret("tenant-b"))
    a_secret = ray.get(controller.namespace_secret("tenant-a"))
    forged = auth.Authority(peer, auth.KIND_NAMESPACE, "tenant-a", auth.request_key(b_secret))
    # tenant-b's own MAC is valid, but the pages are tenant-a's: none served.
    own = auth.Authority.of_namespace(peer, "tenant-b", b_secret)
    assert read_raw(endpoint, keys, own)[:2] == (wire.STATUS_OK, 0)
    assert read_raw(endpoint, keys, forged)[:2] == (wire.STATUS_REFUSED, 0)
    # The same frame with tenant-a's own MAC reads the pages: the refusals above are real.
    status, num_pages, body = read_raw(endpoint, keys,
                                       auth.Authority.of_namespace(peer, "tenant-a", a_secret))
    assert (status, num_pages) == (wire.STATUS_OK, 4) and body[: len(page_of(service, 0))] \
        == page_of(service, 0)


def read_raw(endpoint, keys, authority) -> tuple[int, int, bytes]:
    """A read through a raw socket: handshake, one request; (status, pages, page bytes)."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=5.0) as sock:
        session = auth.client_handshake(sock, authority.peer_key)
        sock.sendall(wire.encode_request(wire.ReadRequest(GEOMETRY, tuple(keys)), authority,
                                         session))
        status, num_pages, page_bytes = wire.REPLY.unpack(
            wire.recv_exact(sock, wire.REPLY.size))
        body = wire.recv_exact(sock, num_pages * page_bytes) if num_pages else b""
        if num_pages:
            sock.sendall(wire.ACK)
            wire.recv_exact(sock, wire.VERDICT.size)
    return status, num_pages, body


def redis_dump(url: str) -> list[bytes]:
    """Every key in Redis and everything stored under it, whatever its type."""
    client = redis.Redis.from_url(url)
    found = []
    try:
        for key in client.scan_iter(count=1000):
            found.append(key)
            kind = client.type(key).decode()
            if kind == "string":
                found.append(client.get(key))
            elif kind == "hash":
                found += [part for pair in client.hgetall(key).items() for part in pair]
            elif kind == "list":
                found += client.lrange(key, 0, -1)
            elif kind == "set":
                found += list(client.smembers(key))
            elif kind == "zset":
                found += [member for member, _ in client.zrange(key, 0, -1, withscores=True)]
            else:
                found.append(client.dump(key))
    finally:
        client.close()
    return found


def test_no_secret_is_kept_in_redis(service):
    config = service["config"]
    wait_until(lambda: any(b":n:" in item for item in redis_dump(service["redis"].url)), 10,
               "the directory to write its pages to Redis")
    master, _ = secrets.load_master(config.disk_dir)
    forbidden = {"master": master, "peer": auth.peer_key(master), "node": auth.node_key(master),
                 **{ns: secrets.namespace_secret(master, ns)
                    for ns in ("default", "tenant-a", "tenant-b")}}
    dump = redis_dump(service["redis"].url)
    assert len(dump) > 4  # the directory's nodes and pages are there
    for name, secret in forbidden.items():
        assert not any(secret in item for item in dump), f"the {name} secret is in Redis"
    assert b"raykv:raykv:key-secret" not in dump  # the old master was deleted at start
    assert not any(b"L" * 32 in item for item in dump)
