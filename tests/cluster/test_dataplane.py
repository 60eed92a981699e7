"""The data plane between real node actors on a 3-raylet Cluster: each node actor listens on
one socket on its node's address and nothing else; connections are reused across gets and
closed on stop(); an owner that stalls, then dies, while a reader waits on it is a miss, not a
hang and not wrong bytes; replication (pull) goes through the same page servers.

Every test runs over TCP and over NIXL (UCX picks shared memory between the simulated nodes'
processes, its control messages on loopback TCP): the node actors serve NIXL pushes beside
TCP reads, and the replicas and node actors read with NIXL."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil
import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.handles import NodeHandle
from cluster import CacheConfig, ModelSpec, start, stop
from cluster.api import key_chain
from cluster.core.geometry import PageGeometry
from tests.cluster.conftest import node_id_of, wait_until
from tests.cluster.replica import replica_on
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
GEOMETRY = PageGeometry.of(TINY, 16)
TIMEOUT_S = 3.0
# UCX on loopback only (its listeners too); the workers inherit it from the raylets, which
# the module's Cluster starts after this import.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def nixl_installed() -> bool:
    from cluster.core.dataplane.nixl_agent import load_api

    try:
        load_api()
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def nodes(request, ray_cluster, disk_root):
    if request.param == "nixl" and not nixl_installed():
        pytest.skip("NIXL is not installed")
    # No control loop: its replication would pull pages too, and these tests count them.
    start(CacheConfig(page_tokens=16, device_bytes=0, host_bytes=256 * 8192,
                      disk_bytes=1 << 20, disk_dir=disk_root, call_timeout_s=TIMEOUT_S,
                      rebalance=False, transport=request.param))
    a, b = node_id_of("node_a"), node_id_of("node_b")
    yield {"a": a, "b": b, "ra": replica_on(a, TINY), "rb": replica_on(b, TINY),
           "transport": request.param}
    stop()  # the next transport starts its own service


def node(node_id: str) -> NodeHandle:
    return NodeHandle.lookup(node_id, CacheConfig())


def stats(node_id: str) -> dict:
    return ray.get(node(node_id).stats())


def put_on_a(nodes, first: int, seed: int) -> tuple[list[int], torch.Tensor]:
    tokens, kv = list(range(first, first + 64)), kv_for(TINY, 64, seed=seed)
    assert ray.get(nodes["ra"].put.remote(tokens, kv)) == 64
    wait_until(lambda: len(ray.get(nodes["rb"].located.remote(tokens))) == 4, 10,
               "the directory to hear of the put")
    return tokens, kv


def listening(pid: int) -> set[tuple[str, int]]:
    return {c.laddr[:2] for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


@ray.remote(num_cpus=0)
class PlainWorker:
    """An async Ray actor doing nothing, as the node actor is one: what such a worker
    process listens on without raykv (Ray's own server)."""

    async def pid(self) -> int:
        return os.getpid()


def test_a_node_actor_listens_on_its_page_server_and_nothing_more(nodes):
    endpoint = ray.get(node(nodes["a"]).dataplane())
    pid = stats(nodes["a"])["pid"]
    strategy = NodeAffinitySchedulingStrategy(nodes["a"], soft=False)
    # The handle is kept: a dropped one ends the worker, its listeners with it (they were
    # seen gone before they were counted).
    worker = PlainWorker.options(scheduling_strategy=strategy).remote()
    plain = ray.get(worker.pid.remote())
    extra = listening(pid)
    # A Ray worker's own, plus the page server; with NIXL, plus UCX's one listener, on
    # loopback (UCX_NET_DEVICES=lo above), which NIXL's writes into this node connect to.
    ucx = {address for address in extra - listening(plain) if address[0] == "127.0.0.1"
           and address != (endpoint.host, endpoint.port)} if nodes["transport"] == "nixl" \
        else set()
    assert len(ucx) == (1 if nodes["transport"] == "nixl" else 0)
    assert len(extra) == len(listening(plain)) + 1 + len(ucx)
    assert (endpoint.host, endpoint.port) in extra and endpoint.transport == nodes["transport"]
    assert endpoint.host == ray.util.get_node_ip_address() and endpoint.host != "0.0.0.0"


def nixl_up(replica) -> bool:
    """Whether the replica's NIXL agent is up (made in the background after connect(); its
    reads go over TCP until then)."""
    def up(_self) -> bool:
        from cluster.core.dataplane.nixl_agent import shared_agent

        return shared_agent(wait_s=60.0) is not None

    return ray.get(replica.__ray_call__.remote(up))


def test_gets_go_through_the_data_plane_on_reused_connections(nodes):
    if nodes["transport"] == "nixl":
        assert nixl_up(nodes["rb"])
    before = stats(nodes["a"])["dataplane"]
    for i in range(3):
        tokens, kv = put_on_a(nodes, 10_000 + 100 * i, seed=i)
        num_tokens, got = ray.get(nodes["rb"].get.remote(tokens))
        assert num_tokens == 64 and torch.equal(got, kv)
    wait_until(lambda: stats(nodes["b"])["pulled_pages"] >= 12, 10, "B to pull what it read")
    after = stats(nodes["a"])["dataplane"]
    requests = after["requests"] - before["requests"]
    assert requests >= 6  # 3 gets + B's 3 pulls
    # B's replica and B's node actor keep their connections across requests (a second one
    # only while another pull of theirs is still in flight).
    assert after["accepted"] - before["accepted"] <= min(4, requests - 2)
    assert after["served_pages"] - before["served_pages"] == 24
    if nodes["transport"] == "nixl":  # every page was written by NIXL, none sent over TCP
        assert after["pushed_pages"] - before["pushed_pages"] == 24


def test_replication_pulls_through_the_page_servers(nodes):
    tokens, kv = put_on_a(nodes, 20_000, seed=7)
    keys = key_chain(TINY).keys(tokens)
    c = node_id_of("node_c")
    assert ray.get(node(c).pull(GEOMETRY, {nodes["a"]: keys})) == 4
    assert stats(c)["pulled_pages"] >= 4
    # The pull readies C's next host chunk off its path (a chunk's worth free, or the tier
    # full), so the next pull does not fault one in on its own.
    wait_until(lambda: host_room_ahead(stats(c)), 10, "C to ready a host chunk ahead")
    wait_until(lambda: all(any(n == c for n, _ in places) for places in
                           ray.get(nodes["rb"].located.remote(tokens))), 10,
               "the directory to list C as a holder")


def host_room_ahead(node_stats: dict) -> bool:
    host = node_stats["memory"]["tiers"]["host"]
    free_bytes = host["held_bytes"] - node_stats["bytes"]["host"]
    return free_bytes >= node_stats["memory"]["chunk_bytes"] or \
        host["held_bytes"] + node_stats["memory"]["chunk_bytes"] > host["capacity_bytes"]


def test_an_owner_that_stalls_then_dies_mid_read_is_a_miss_not_a_hang(nodes):
    tokens, _ = put_on_a(nodes, 30_000, seed=8)
    pid = stats(nodes["a"])["pid"]
    os.kill(pid, signal.SIGSTOP)  # A's page server accepts in the kernel, answers nothing
    try:
        started_s = time.monotonic()
        assert ray.get(nodes["rb"].get.remote(tokens), timeout=4 * TIMEOUT_S) == (0, None)
        assert time.monotonic() - started_s < 2 * TIMEOUT_S + 1
        ref = nodes["rb"].get.remote(tokens)
        time.sleep(0.5)  # the reader now waits on A
    finally:
        os.kill(pid, signal.SIGKILL)  # dies mid-read: its sockets close under the reader
    assert ray.get(ref, timeout=4 * TIMEOUT_S) == (0, None)
    wait_until(lambda: answers(nodes["a"]), 60, "Ray to restart A's node actor")


def answers(node_id: str) -> bool:
    try:
        return ray.get(node(node_id).ping(), timeout=30) == node_id
    except ray.exceptions.RayError:
        return False


def test_stop_closes_the_page_servers_and_this_process_connections(nodes):
    wait_until(lambda: answers(nodes["a"]) and answers(nodes["b"]), 60, "both node actors")
    endpoints = [ray.get(node(n).dataplane()) for n in (nodes["a"], nodes["b"])]
    pids = [stats(n)["pid"] for n in (nodes["a"], nodes["b"])]
    stop()
    for endpoint, pid in zip(endpoints, pids, strict=True):
        # Closed by its own process. Another service on this machine (a test tier running
        # alongside) may take the freed port at once: only a listener of ours would count.
        try:
            assert (endpoint.host, endpoint.port) not in listening(pid)
        except psutil.NoSuchProcess:
            pass  # the node actor's worker is gone, its sockets with it
        if not _listener_elsewhere(endpoint.port):
            with pytest.raises(OSError):
                socket.create_connection(endpoint.address, timeout=2.0)


def _listener_elsewhere(port: int) -> bool:
    """Whether some process now listens on `port` (another service took it)."""
    return any(c.laddr and c.laddr[1] == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections(kind="tcp"))
