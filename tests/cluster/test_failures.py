"""Failures on a 3-node cluster: a node removed under load, the directory killed (recovered
from Redis, and from node inventories without it), Redis killed and brought back."""

from __future__ import annotations

import time

import pytest
import ray
import redis

from actors.handles import DirectoryHandle
from cluster import CacheConfig, ModelSpec, start, stop
from cluster.tools.redis_server import RedisServer
from tests.cluster.conftest import node_id_of, wait_until
from tests.cluster.replica import replica_on
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
SHARDS = 2


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def config(disk_root: str, redis_url: str | None, key_space: str = "") -> CacheConfig:
    # No control loop: the Redis checks compare the mirror with a directory at rest.
    return CacheConfig(page_tokens=16, device_bytes=0, host_bytes=256 * 8192,
                       disk_bytes=1 << 20, disk_dir=disk_root, num_directory_shards=SHARDS,
                       redis_url=redis_url, rebalance=False, redis_key_space=key_space)


def prompt(index: int) -> list[int]:
    return [10_000 + index * 64 + i for i in range(64)]


def directory() -> DirectoryHandle:
    return DirectoryHandle.lookup(CacheConfig(num_directory_shards=SHARDS))


def shard_stats() -> list[dict]:
    return ray.get(directory().stats())


def kill_directory() -> None:
    """Kill every shard for real; Ray restarts them (max_restarts=-1)."""
    for shard in directory().shards:
        ray.kill(shard, no_restart=False)


def restart_directory() -> None:
    kill_directory()
    time.sleep(0.5)
    wait_until(_answers, 30, "the directory shards to come back")


def _answers() -> bool:
    try:
        ray.get(directory().ping(), timeout=2)
        return True
    except (ray.exceptions.RayError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def replicas(ray_cluster):
    return {}


def replica(name: str, cache: dict):
    node_id = node_id_of(f"node_{name}")
    if name not in cache or cache[name][0] != node_id:
        cache[name] = (node_id, replica_on(node_id, TINY))
    return cache[name][1]


def wait_until_located(client, indexes) -> None:
    wait_until(lambda: all(len(ray.get(client.located.remote(prompt(i)))) == 4
                           for i in indexes), 10, "the directory to hear of the puts")


def test_directory_recovers_from_redis(ray_cluster, disk_root, redis_server, replicas):
    start(config(disk_root, redis_server.url))
    ra = replica("a", replicas)
    for index in range(4):
        assert ray.get(ra.put.remote(prompt(index), kv_for(TINY, 64, index))) == 64
    wait_until_located(ra, range(4))  # a commit does not wait for the directory
    assert all(ray.get(directory().flush_redis()))
    restart_directory()
    stats = shard_stats()
    assert all(s["recovered"]["source"] == "redis" for s in stats)
    assert sum(s["recovered"]["locations"] for s in stats) == 16
    rb = replica("b", replicas)
    assert ray.get(rb.lookup.remote(prompt(3))) == 64
    assert ray.get(rb.get.remote(prompt(2)))[0] == 64


def test_directory_back_from_a_stale_redis_copy_resyncs_lost_events(redis_server, replicas):
    """Redis refuses writes while write-behind is pending, and the directory dies: it comes
    back from a copy that lacks batches it had acknowledged. The nodes notice (their
    acked_upto is past its watermark) and resend their inventories: nothing put meanwhile is
    lost, and no gap is left waiting."""
    ra, rb = replica("a", replicas), replica("b", replicas)
    redis_server.refuse_writes()
    try:
        for index in range(20, 24):  # acknowledged by the directory, never reach Redis
            assert ray.get(ra.put.remote(prompt(index), kv_for(TINY, 64, index))) == 64
        wait_until_located(ra, range(20, 24))
        wait_until(lambda: not any(s["redis"]["healthy"] for s in shard_stats()), 15,
                   "the shards' write-behind to fail")
        restart_directory()
        stats = shard_stats()  # loaded (reads still work) from the stale copy
    finally:
        redis_server.refuse_writes(False)
    assert all(s["recovered"]["source"] == "redis" for s in stats)
    assert sum(s["recovered"]["locations"] for s in stats) == 16  # prompts 0-3 only
    wait_until(lambda: all(ray.get(rb.lookup.remote(prompt(i))) == 64 for i in range(20, 24)),
               10, "the nodes to resync what the stale copy lacked")
    assert ray.get(rb.get.remote(prompt(22)))[0] == 64
    assert ray.get(rb.lookup.remote(prompt(1))) == 64
    stats = shard_stats()
    assert all(s["waiting_batches"] == 0 and s["tombstones"] == 0 for s in stats), stats


def test_redis_outage_keeps_serving_and_catches_up(ray_cluster, redis_server, replicas):
    ra = replica("a", replicas)
    redis_server.stop()
    for index in range(4, 8):  # served while Redis is down
        assert ray.get(ra.put.remote(prompt(index), kv_for(TINY, 64, index))) == 64
        assert ray.get(ra.lookup.remote(prompt(index))) == 64
    wait_until(lambda: not any(s["redis"]["healthy"] for s in shard_stats()), 10,
               "the shards to notice Redis is down")
    redis_server.start()  # same port, empty: the shards rewrite everything
    wait_until(lambda: all(s["redis"]["healthy"] for s in shard_stats()), 15,
               "the shards to catch up with Redis")
    stats = shard_stats()
    assert _redis_locations(redis_server.url) == sum(
        sum(s["nodes"].values()) for s in stats)
    restart_directory()  # and what Redis now holds is enough to recover from
    assert all(s["recovered"]["source"] == "redis" for s in shard_stats())
    assert ray.get(ra.lookup.remote(prompt(6))) == 64


def _redis_locations(url: str) -> int:
    client = redis.Redis.from_url(url)
    return sum(client.hlen(name) for name in client.scan_iter(match="raykv:*:n:*"))


def test_another_cluster_on_the_same_redis_recovers_none_of_its_directory(
        ray_cluster, disk_root, redis_server, replicas):
    """Two clusters on one Redis (a RayService's old and new RayCluster during an upgrade,
    each with its own RAY_external_storage_namespace from KubeRay) shared the directory's
    keys: the new one recovered the old one's locations, on nodes it does not have. Each
    cluster's keys now carry its key space."""
    assert _redis_locations(redis_server.url) > 0  # the earlier tests' cluster's
    stop()
    start(config(disk_root + "/space-b", redis_server.url, key_space="cluster-b"))
    replicas.clear()
    assert sum(s["recovered"]["locations"] for s in shard_stats()) == 0
    ra = replica("a", replicas)
    assert ray.get(ra.put.remote(prompt(200), kv_for(TINY, 64, 200))) == 64
    wait_until_located(ra, [200])
    assert all(ray.get(directory().flush_redis()))
    client = redis.Redis.from_url(redis_server.url)
    assert sum(client.hlen(name) for name in
               client.scan_iter(match="raykv:raykv:cluster-b:dir*:n:*")) == 4


def test_directory_rebuilds_from_inventories_without_redis(ray_cluster, disk_root, replicas):
    stop()
    start(config(disk_root + "/no-redis", None))
    ra = replica("a", {})
    replicas.clear()
    replicas["a"] = (node_id_of("node_a"), ra)
    for index in range(3):
        assert ray.get(ra.put.remote(prompt(100 + index), kv_for(TINY, 64, index))) == 64
    restart_directory()
    # The shards come back empty; each node's next heartbeat is answered RESYNC and the
    # node sends its whole inventory.
    # (A's own lookups hit at once, from its node: wait on the directory itself.)
    wait_until(lambda: sum(s["num_keys"] for s in shard_stats()) >= 12, 10,
               "the index to be rebuilt from node inventories")
    assert all(s["recovered"]["source"] == "empty" for s in shard_stats())
    assert ray.get(ra.lookup.remote(prompt(102))) == 64


@ray.remote(num_cpus=0)
def workload(replica_handle, prompts: list[list[int]], duration_s: float) -> dict:
    """Bounded concurrent gets from another node: counts hits, misses and errors."""
    counts = {"hits": 0, "misses": 0, "errors": 0, "calls": 0}
    deadline_s = time.monotonic() + duration_s
    while time.monotonic() < deadline_s and counts["calls"] < 2000:
        refs = [replica_handle.get.remote(p) for p in prompts]
        for ref in refs:
            counts["calls"] += 1
            try:
                num_tokens, _ = ray.get(ref)
                counts["hits" if num_tokens else "misses"] += 1
            except Exception:
                counts["errors"] += 1
    return counts


def test_node_removed_under_load_gives_misses_not_errors(ray_cluster, replicas):
    cluster, workers = ray_cluster
    ra, rb = replica("a", replicas), replica("b", {})
    node_a = node_id_of("node_a")
    for index in range(200, 204):
        assert ray.get(ra.put.remote(prompt(index), kv_for(TINY, 64, index))) == 64
    only_on_a = prompt(250)
    assert ray.get(ra.put.remote(only_on_a, kv_for(TINY, 64, 250))) == 64
    running = workload.remote(rb, [prompt(i) for i in range(200, 204)], 6.0)
    time.sleep(1.0)
    cluster.remove_node(workers["node_a"])
    removed_at_s = time.monotonic()
    purged = wait_until(lambda: _no_location_on(node_a), 10, "A's pages to be purged")
    purge_s = time.monotonic() - removed_at_s
    counts = ray.get(running)
    assert counts["errors"] == 0 and counts["calls"] > 0, counts
    assert purged and purge_s <= 5.0, f"purge took {purge_s:.1f} s"
    assert ray.get(rb.lookup.remote(only_on_a)) == 0  # a miss, not a stale location
    assert ray.get(rb.get.remote(only_on_a)) == (0, None)


def _no_location_on(node_id: str) -> bool:
    return all(node_id not in s["nodes"] for s in shard_stats())
