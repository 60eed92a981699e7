"""Pages stored on one node are served on another: put on A, get on B, byte-exact, through
the data plane (A's page server sends them straight from its slab into B's tensor)."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.handles import ControllerHandle, NodeHandle
from cluster import CacheConfig, ModelSpec, start
from cluster.api import key_chain
from cluster.core.geometry import PageGeometry
from tests.cluster.conftest import node_args, node_id_of, wait_until
from tests.cluster.replica import replica_on
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
GEOMETRY = PageGeometry.of(TINY, 16)


@pytest.fixture(scope="module")
def nodes(ray_cluster, disk_root):
    # No control loop: its replication would pull pages too, and these tests count requests.
    start(CacheConfig(page_tokens=16, device_bytes=0, host_bytes=256 * 8192,
                      disk_bytes=1 << 20, disk_dir=disk_root, num_directory_shards=2,
                      rebalance=False))
    a, b = node_id_of("node_a"), node_id_of("node_b")
    return {"a": a, "b": b, "ra": replica_on(a, TINY), "rb": replica_on(b, TINY)}


def node_stats(node_id: str) -> dict:
    return ray.get(NodeHandle.lookup(node_id, CacheConfig()).stats())


def served_pages(node_id: str) -> int:
    return node_stats(node_id)["dataplane"]["served_pages"]


def put_on(replica, tokens, kv) -> int:
    """Put through a replica, then wait until the directory knows (the commit does not wait
    for the node's event flush)."""
    stored = ray.get(replica.put.remote(tokens, kv))
    wait_until(lambda: len(ray.get(replica.located.remote(tokens))) * 16 >= stored, 10,
               "the directory to hear of the put")
    return stored


def test_every_kv_node_has_an_actor(nodes):
    members = ray.get(ControllerHandle.lookup(CacheConfig()).stats())["members"]
    assert len(members) == 3 and {nodes["a"], nodes["b"]} <= set(members)
    assert ray.get(nodes["ra"].node.remote()) == nodes["a"]


def test_put_on_a_get_on_b_is_byte_exact(nodes):
    tokens, kv = list(range(64)), kv_for(TINY, 64, seed=1)
    assert put_on(nodes["ra"], tokens, kv) == 64
    assert ray.get(nodes["rb"].lookup.remote(tokens)) == 64
    served_before = served_pages(nodes["a"])
    num_tokens, got = ray.get(nodes["rb"].get.remote(tokens))
    assert num_tokens == 64 and torch.equal(got, kv)
    client = ray.get(nodes["rb"].stats.remote())["client"]
    assert client["remote_pages"] == 4
    assert served_pages(nodes["a"]) >= served_before + 4  # the get's 4 (and B's pull of them)

    def on_both() -> bool:  # B keeps the pages it fetched (adopted off the critical path)
        located = ray.get(nodes["rb"].located.remote(tokens))
        return all({nodes["a"], nodes["b"]} <= {n for n, _ in places} for places in located)

    wait_until(on_both, 10, "B to adopt the pages it fetched")


def test_prefix_mixing_local_and_remote_pages(nodes):
    tokens, kv = list(range(100, 196)), kv_for(TINY, 96, seed=2)
    assert put_on(nodes["ra"], tokens, kv) == 96
    assert ray.get(nodes["rb"].put.remote(tokens[:32], kv[:, :, :, :32])) == 32
    before = ray.get(nodes["rb"].stats.remote())["client"]
    num_tokens, got = ray.get(nodes["rb"].get.remote(tokens))
    assert num_tokens == 96 and torch.equal(got, kv)
    after = ray.get(nodes["rb"].stats.remote())["client"]
    assert after["local_pages"] - before["local_pages"] == 2
    assert after["remote_pages"] - before["remote_pages"] == 4


def test_prefetch_pulls_remote_pages_into_local_host(nodes):
    tokens, kv = list(range(300, 364)), kv_for(TINY, 64, seed=3)
    put_on(nodes["ra"], tokens, kv)
    assert ray.get(nodes["rb"].prefetch.remote(tokens)) == 64

    def on_b() -> bool:
        located = ray.get(nodes["rb"].located.remote(tokens))
        return all((nodes["b"], 1) in places for places in located)

    wait_until(on_b, 10, "prefetched pages to appear in B's host tier")
    requests_before = node_stats(nodes["a"])["dataplane"]["requests"]
    num_tokens, got = ray.get(nodes["rb"].get.remote(tokens))
    assert num_tokens == 64 and torch.equal(got, kv)
    assert node_stats(nodes["a"])["dataplane"]["requests"] == requests_before  # all local now


def test_concurrent_requests_share_one_pull(nodes):
    tokens, kv = list(range(500, 628)), kv_for(TINY, 128, seed=4)
    put_on(nodes["ra"], tokens, kv)
    keys = key_chain(TINY).keys(tokens)
    requests_before = node_stats(nodes["a"])["dataplane"]["requests"]
    b_node = NodeHandle.lookup(nodes["b"], CacheConfig())
    pulled = ray.get([b_node.pull(GEOMETRY, {nodes["a"]: keys}) for _ in range(6)])
    assert sorted(pulled) == [0] * 5 + [8]  # one request pulled, five waited for it
    assert node_stats(nodes["a"])["dataplane"]["requests"] == requests_before + 1
    num_tokens, got = ray.get(nodes["rb"].get.remote(tokens))
    assert num_tokens == 128 and torch.equal(got, kv)


def test_concurrent_gets_from_replicas_are_each_served_and_pulled_once(nodes):
    tokens, kv = list(range(700, 764)), kv_for(TINY, 64, seed=5)
    put_on(nodes["ra"], tokens, kv)
    replicas = [replica_on(nodes["b"], TINY) for _ in range(3)]
    ray.get([r.node.remote() for r in replicas])  # all three up before the gets go out
    results = ray.get([r.get.remote(tokens) for r in replicas])
    assert all(n == 64 and torch.equal(got, kv) for n, got in results)
    # B's node keeps one copy, however many replicas fetched the pages.
    wait_until(lambda: node_stats(nodes["b"])["pages"]["host"] >= 4, 10, "B's pull")
    keys = key_chain(TINY).keys(tokens)
    b_node = NodeHandle.lookup(nodes["b"], CacheConfig())
    assert ray.get(b_node.pull(GEOMETRY, {nodes["a"]: keys})) == 0  # all here already


def test_a_node_that_joins_late_gets_an_actor(ray_cluster, nodes):
    cluster, _ = ray_cluster
    cluster.add_node(**node_args("node_d"))
    late = wait_until(lambda: _alive("node_d"), 30, "node_d to join")
    controller = ControllerHandle.lookup(CacheConfig())
    wait_until(lambda: late in ray.get(controller.stats())["members"], 30,
               "the controller to place a node actor on node_d")
    assert ray.get(NodeHandle.lookup(late, CacheConfig()).ping()) == late


def _alive(resource: str) -> str | None:
    try:
        return node_id_of(resource)
    except AssertionError:
        return None
