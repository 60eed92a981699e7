"""Tiers through the service: demotion to disk, promotion on access, prefetch, pins, and the
disk tier surviving a restart of its node actor."""

from __future__ import annotations

import time

import ray
import torch

from cluster import ModelSpec, connect
from cluster.calls import run_sync
from cluster.core.geometry import PageGeometry
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")
PAGE_BYTES = 8192  # tiny-llama, 16 tokens, float32
# Exact tier counts: no demotion ahead of need (test_demote_ahead below has it on).
SMALL = dict(device_bytes=0, host_bytes=4 * PAGE_BYTES, disk_bytes=64 * (PAGE_BYTES + 4096),
             demote_ahead=False)




def prompt(index: int) -> list[int]:
    return [index * 100 + i for i in range(32)]  # two pages


def fill(client, num_prompts: int) -> None:
    for index in range(num_prompts):
        assert client.put(prompt(index), kv_for(TINY, 32, index)) == 32


def wait_for_new_epoch(client, old_epoch: int, timeout_s: float = 30) -> dict:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        stats = client.stats()["node"]  # {"error": ...} while the actor restarts
        if stats.get("epoch", old_epoch) != old_epoch:
            return stats
        time.sleep(0.2)
    raise AssertionError("the node actor did not come back within the timeout")


def tiers(client) -> dict:
    return client.stats()["node"]["pages"]


def test_pressure_demotes_to_disk_and_get_promotes(service):
    service(**SMALL)
    client = connect(TINY)
    fill(client, 6)  # 12 pages, host holds 4
    assert tiers(client) == {"device": 0, "host": 4, "disk": 8}
    num_tokens, got = client.get(prompt(0))  # on disk: read from the slab files, byte-exact
    assert num_tokens == 32 and torch.equal(got, kv_for(TINY, 32, 0))
    assert client.counters["disk_direct_pages"] == 2
    # The node hears of the read with the client's touches and reads the pages up, as an
    # acquire would have: promoted two, demoted two.
    deadline_s = time.monotonic() + 5
    while _tier_of(client, prompt(0)) != {1}:
        assert time.monotonic() < deadline_s, tiers(client)
        time.sleep(0.05)
    after = tiers(client)
    assert after["host"] == 4 and after["disk"] == 8


def test_device_tier_is_top_and_demotes_to_host(service):
    service(device_bytes=2 * PAGE_BYTES, host_bytes=2 * PAGE_BYTES, disk_bytes=0)
    client = connect(TINY)
    fill(client, 2)
    assert tiers(client) == {"device": 2, "host": 2, "disk": 0}
    fill_more = [9000 + i for i in range(32)]
    client.put(fill_more, kv_for(TINY, 32, 99))  # no disk: the coldest pages are dropped
    assert tiers(client) == {"device": 2, "host": 2, "disk": 0}
    assert client.lookup(fill_more) == 32
    assert client.lookup(prompt(0)) == 0  # dropped, and the directory knows


def test_prefetch_promotes_disk_pages(service):
    service(**SMALL)
    client = connect(TINY)
    fill(client, 6)
    assert client.prefetch(prompt(0)) == 32
    deadline_s = time.monotonic() + 20  # not a speed check: a loaded 2-core CI runner
    while tiers(client)["disk"] != 8 or _tier_of(client, prompt(0)) != {1}:
        assert time.monotonic() < deadline_s, (
            f"prefetch did not promote within 20 s: pages {tiers(client)}, prompt 0 in tiers "
            f"{_tier_of(client, prompt(0))}")
        time.sleep(0.05)


def _tier_of(client, tokens) -> set[int]:
    located = client.locate_keys(client.keys(tokens))
    return {tier for locations in located for _, tier in locations}


def test_pinned_page_survives_pressure(service):
    service(**SMALL)
    client = connect(TINY)
    fill(client, 2)  # 4 pages: host is full
    geometry = PageGeometry.of(TINY, 16)
    keys = client.keys(prompt(0))
    epoch, lease_id, slots, _ = ray.get(client.local.acquire(geometry, keys))
    assert run_sync(client.view.slabs.ensure(epoch), 10)
    assert len(slots) == 2
    fill_base = 50
    for index in range(fill_base, fill_base + 4):  # 8 more pages through a 4-page host tier
        client.put(prompt(index), kv_for(TINY, 32, index))
    for page, (tier, slot, _) in enumerate(slots):  # still there, untouched, in the same slot
        expected = kv_for(TINY, 32, 0)[:, :, :, page * 16:(page + 1) * 16]
        assert torch.equal(client.view.slabs.page(tier, slot), expected)
    ray.get(client.local.release(lease_id))
    fill(client, 1)
    assert client.get(prompt(0))[0] == 32


def test_disk_pages_survive_node_actor_restart(service):
    service(**SMALL)
    client = connect(TINY)
    fill(client, 6)  # prompts 0..3 on disk, 4..5 in host memory
    old_epoch = client.stats()["node"]["epoch"]
    # Ray restarts it; memory tiers are gone, disk is not.
    ray.kill(client.local.actor, no_restart=False)
    stats = wait_for_new_epoch(client, old_epoch)
    assert stats["pages"] == {"device": 0, "host": 0, "disk": 8}
    for index in range(4):
        num_tokens, got = client.get(prompt(index))
        assert num_tokens == 32 and torch.equal(got, kv_for(TINY, 32, index))
    assert client.lookup(prompt(5)) == 0  # it was in host memory


def test_a_touch_after_the_node_shut_down_is_a_miss_not_an_error(service):
    """Found by a probe: a purge closed the disk while a client's touch (sent without waiting
    for its answer) read pages up from it; Ray printed the touch's AssertionError ("disk
    arena is closed") as an unhandled error. Touches of disk pages after a shutdown now
    answer 0."""
    service(**SMALL)
    client = connect(TINY)
    fill(client, 6)  # prompts 0..3 on disk
    geometry = PageGeometry.of(TINY, 16)
    keys = client.chain.keys(prompt(0))
    ray.get(client.local.actor.shutdown.remote())
    assert ray.get(client.local.actor.touch.remote(geometry, keys)) == 0


# ---- the node's held-pages index: a get of another client's pages with no call ---------------


def count_calls(client, names=("acquire", "descriptors", "reserve", "commit")) -> dict:
    """Count the calls `client` makes on its node actor (its handle's methods, wrapped)."""
    counts = dict.fromkeys(names, 0)
    handle = client.view.local

    def counted(name, method):
        def call(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)
        return call

    for name in names:
        setattr(handle, name, counted(name, getattr(handle, name)))
    return counts


def test_a_fresh_client_gets_pages_another_put_with_no_call(service):
    """A puts; B, connected afresh (no notes), gets them from the node's held-pages index:
    no acquire, no call on the path, the bytes exact. Then the node demotes them to disk:
    B's get must not copy the freed slots (their generations moved): it reads the pages now
    on disk from the node's slab files itself (cluster/disk_direct.py: still no call), and
    the bytes are still exact."""
    service(**SMALL)
    writer, reader = connect(TINY), connect(TINY)
    calls = count_calls(reader)
    fill(writer, 2)  # 4 pages: the host tier is full
    assert writer.puts.settle(writer.timeout_s)  # committed (a leased put commits after)
    assert reader.view.slabs._held is not None, "the reader did not map the index at connect"
    for index in range(2):
        num_tokens, got = reader.get(prompt(index))
        assert num_tokens == 32 and torch.equal(got, kv_for(TINY, 32, index))
    assert calls == {"acquire": 0, "descriptors": 0, "reserve": 0, "commit": 0}
    assert reader.counters["held_pages"] == 4 and reader.counters["local_pages"] == 4
    # The reads reach the node (its eviction policy and counters) in a batch, off the path.
    deadline_s = time.monotonic() + 5
    while reader.stats()["node"].get("optimistic_hits_pages", 0) < 4:
        assert time.monotonic() < deadline_s, reader.stats()["node"]
        time.sleep(0.1)

    fill_more = [9000 + i for i in range(64)]  # 4 more pages: 4 of the 8 go to disk
    assert writer.put(fill_more, kv_for(TINY, 64, 77)) == 64
    assert writer.puts.settle(writer.timeout_s)
    assert tiers(writer) == {"device": 0, "host": 4, "disk": 4}
    other = connect(TINY)  # no notes at all: only the index could mislead it
    other_calls = count_calls(other)
    expected = [(prompt(0), kv_for(TINY, 32, 0)), (prompt(1), kv_for(TINY, 32, 1)),
                (fill_more, kv_for(TINY, 64, 77))]
    on_disk = [2 in _tier_of(writer, tokens) for tokens, _ in expected]
    assert any(on_disk)
    for client, counted_calls in ((reader, calls), (other, other_calls)):
        for (tokens, kv), disk in zip(expected, on_disk, strict=True):
            direct, acquires = client.counters["disk_direct_pages"], counted_calls["acquire"]
            # A page on disk is read from the slab files with no call. The reader's notes of
            # the slots those pages left are stale: it may ask the node from there instead
            # (which reads them up). What comes back is a prefix, byte for byte.
            num_tokens, got = client.get(tokens)
            assert num_tokens % 16 == 0 and num_tokens <= len(tokens)
            if num_tokens:
                assert torch.equal(got, kv[:, :, :, :num_tokens])
            read_directly = client.counters["disk_direct_pages"] > direct
            asked = counted_calls["acquire"] > acquires
            assert not disk or read_directly or (client is reader and asked)

    # Dropped pages: the index withdrew them and the notes' slots moved on; a miss.
    geometry = PageGeometry.of(TINY, 16)
    dropped, deadline_s = 0, time.monotonic() + 5
    while dropped < 2:  # the gets' leases end with the clients' next batch (touches.py)
        assert time.monotonic() < deadline_s, f"only {dropped} of prompt 0's pages dropped"
        dropped += ray.get(writer.local.discard(geometry, writer.keys(prompt(0))))
        time.sleep(0.1)
    for client, counted_calls in ((reader, calls), (other, other_calls)):
        acquires = counted_calls["acquire"]
        assert client.get(prompt(0)) == (0, None)
        assert counted_calls["acquire"] == acquires + 1


# ---- demotion ahead of need (cluster/core/demote_ahead.py) ---------------------------------


def test_the_node_demotes_ahead_so_a_read_up_lands_in_free_room(service):
    """Batches that found the host tier full teach the node its headroom; its loop then demotes
    the coldest pages between requests, so a later read-up from disk lands in free slots:
    the node's disk writes do not move during that get, and the bytes are exact."""
    # No put lease: its unwritten slots would count as room (demote_ahead.py), and this test
    # watches pages demoted ahead.
    service(**{**SMALL, "host_bytes": 16 * PAGE_BYTES, "demote_ahead": True,
               "put_lease_bytes": 0})
    client = connect(TINY)
    # The node's own read-up is under test: this client asks it for disk pages rather than
    # reading the slab files itself (cluster/disk_direct.py).
    client.view.slabs.use_disk = False
    fill(client, 12)  # 24 pages through a 16-page host tier: the later puts leaned on it
    assert client.puts.settle(client.timeout_s)
    deadline_s = time.monotonic() + 10
    node = client.stats()["node"]
    while node["host_headroom_short_pages"] or not node["demoted_ahead_pages"]:
        assert time.monotonic() < deadline_s, f"no demotion ahead within 10 s: {node}"
        time.sleep(0.05)
        node = client.stats()["node"]
    assert node["host_headroom_pages"] == 2, node  # batches of 2 pages (a quarter caps at 4)
    assert node["pages"]["host"] <= 16 - 2, node
    written = node["disk_bytes_written"]
    num_tokens, got = client.get(prompt(0))  # on disk since the first demotions
    assert num_tokens == 32 and torch.equal(got, kv_for(TINY, 32, 0))
    after = client.stats()["node"]
    assert after["disk_bytes_read"] > node["disk_bytes_read"], (node, after)
    assert after["disk_bytes_written"] == written or after["demoted_ahead_pages"] > \
        node["demoted_ahead_pages"], ("the read-up waited on demotion writes", node, after)
    # Every host page demoted meanwhile was the loop's, after the read-up: none on its path.
    assert after["evictions"]["host"] - node["evictions"]["host"] == \
        after["demoted_ahead_pages"] - node["demoted_ahead_pages"], (node, after)


# ---- checksums ahead (cluster/core/checksums_ahead.py) -------------------------------------


def test_the_node_hashes_new_pages_ahead_so_their_demotion_only_writes(service):
    """The node's loop hashes the pages that came in between requests; pages then pushed down
    to disk are written with those checksums (none hashed on the demotion's path), and read
    back exact."""
    service(**{**SMALL, "host_bytes": 16 * PAGE_BYTES, "put_lease_bytes": 0})
    client = connect(TINY)
    fill(client, 8)  # 16 pages: the host tier, full, nothing demoted yet
    assert client.puts.settle(client.timeout_s)
    deadline_s = time.monotonic() + 10
    node = client.stats()["node"]
    while node["checksum_queued_pages"] or node["checksums_ahead_pages"] < 16:
        assert time.monotonic() < deadline_s, f"pages not hashed ahead within 10 s: {node}"
        time.sleep(0.05)
        node = client.stats()["node"]
    assert node["pages"] == {"device": 0, "host": 16, "disk": 0}, node
    for index in range(8, 12):  # 8 more pages push the 8 coldest down to disk
        assert client.put(prompt(index), kv_for(TINY, 32, index)) == 32
    assert client.puts.settle(client.timeout_s)
    after = client.stats()["node"]
    assert after["pages"]["disk"] == 8 and after["evictions"]["host"] == 8, after
    assert after["inline_checksum_pages"] == 0, after  # every demotion only wrote
    num_tokens, got = client.get(prompt(0))  # on disk: read up, verified
    assert num_tokens == 32 and torch.equal(got, kv_for(TINY, 32, 0))
    assert client.stats()["node"]["disk_checksum_failures"] == 0
