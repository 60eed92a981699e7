"""Leased puts end to end on a local Ray (cluster/puts.py, cluster/core/put_leases.py): a put
into leased slots makes no call and is seen by another client once its background commit
lands; a client that dies holding leased slots loses them to the node; a lapsed lease is a
miss, never wrong bytes."""

from __future__ import annotations

import pytest
import ray
import torch

from cluster import ModelSpec, connect
from cluster.client import fenced_copy
from cluster.core.put_leases import LeaseRequest
from cluster.tools.doomed_writer import DoomedWriter
from tests.kv import kv_for
from tests.waiting import wait_until

TINY = ModelSpec.preset("tiny-llama")
NUM_PAGES = 2  # 32 tokens of 16-token pages
LEASE_BYTES = 256 << 20  # leased puts are opt-in (CacheConfig.put_lease_bytes)


def leased(client, num_slots: int) -> None:
    wait_until(lambda: len(client.puts.pool.free) >= num_slots, 30, "the client's slot lease")


def node_stats(client) -> dict:
    return client.stats()["node"]


def test_a_leased_put_makes_no_call_and_another_client_sees_it_once_committed(service):
    service(put_lease_bytes=LEASE_BYTES)
    writer, reader = connect(TINY), connect(TINY)
    assert writer.put(list(range(32)), kv_for(TINY, 32, 1)) == 32  # reserves; starts the lease
    leased(writer, NUM_PAGES)
    calls = []
    node = writer.local
    for name in ("reserve", "commit", "put_leased"):  # the calls a put could make, counted
        real = getattr(node, name)
        setattr(node, name, lambda *a, _real=real, _name=name: (calls.append(_name),
                                                                _real(*a))[1])
    tokens, kv = list(range(5000, 5032)), kv_for(TINY, 32, 2)
    try:
        assert writer.put(tokens, kv) == 32
        on_path = list(calls)
    finally:
        for name in ("reserve", "commit", "put_leased"):
            delattr(node, name)
    assert "reserve" not in on_path and "commit" not in on_path, on_path
    wait_until(lambda: reader.lookup(tokens) == 32, 10, "the background commit")
    num_tokens, got = reader.get(tokens)
    assert num_tokens == 32 and torch.equal(got, kv)
    num_tokens, got = writer.get(tokens)  # read-your-writes
    assert num_tokens == 32 and torch.equal(got, kv)
    assert writer.counters["leased_pages"] == NUM_PAGES
    stats = node_stats(writer)
    assert stats["leased_pages"] == NUM_PAGES and stats["lapsed_commits"] == 0


def test_a_client_that_dies_with_leased_slots_loses_them_and_nothing_is_served(service):
    service(reserve_lease_s=1.0, put_lease_bytes=LEASE_BYTES)
    client = connect(TINY)
    doomed = DoomedWriter.options(num_cpus=0).remote(TINY)
    tokens, kv = list(range(7000, 7032)), kv_for(TINY, 32, 3)
    held = ray.get(doomed.leased_slots.remote(list(range(6000, 6032)), kv, NUM_PAGES),
                   timeout=60)
    assert held >= NUM_PAGES
    assert node_stats(client)["leased_slots"] >= held
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.lease_then_die.remote(tokens, kv), timeout=60)
    assert client.lookup(tokens) == 0 and client.get(tokens) == (0, None)
    wait_until(lambda: node_stats(client)["leased_slots"] == 0, 10,
               "the dead client's lease to lapse")
    stats = node_stats(client)
    assert stats["expired_slot_leases"] >= 1 and stats["quarantined_slots"] == 0
    assert client.lookup(tokens) == 0
    assert client.put(tokens, kv) == 32
    num_tokens, got = client.get(tokens)
    assert num_tokens == 32 and torch.equal(got, kv)


def test_a_lapsed_lease_is_a_miss_never_wrong_bytes(service):
    """A writer that stalls with leased slots past the lease: its late copy is fenced off and
    its late commit refused, and the slots' new pages stay exact."""
    service(reserve_lease_s=1.0, device_bytes=0, put_lease_bytes=LEASE_BYTES)
    client = connect(TINY)
    client.put(list(range(32)), kv_for(TINY, 32, 1))
    leased(client, NUM_PAGES)
    puts, slabs = client.puts, client.view.slabs
    stale = puts.take(NUM_PAGES)  # held by a writer that stalls now
    lease_id = puts.pool.lease_id
    wait_until(lambda: node_stats(client)["expired_slot_leases"] >= 1, 10,
               "the lease to lapse")
    others = [(list(range(i * 100 + 20000, i * 100 + 20032)), kv_for(TINY, 32, 50 + i))
              for i in range(8)]
    for tokens, kv in others:  # the lapsed slots go to other pages
        assert client.put(tokens, kv) == 32
    tokens, kv = list(range(8000, 8032)), kv_for(TINY, 32, 4)
    blocks, _ = slabs.kv_blocks(stale, kv, torch.arange(NUM_PAGES).numpy())
    assert not fenced_copy(slabs, stale, [(block, rows) for rows, block in blocks])
    keys = client.keys(tokens)
    late = ray.get(client.local.put_leased(client.geometry, LeaseRequest(
        lease_id, tuple(keys), tuple(tuple(p) for p in stale.tolist()))), timeout=30)
    assert late[1].committed == [False] * NUM_PAGES
    assert client.lookup(tokens) == 0
    for other_tokens, other_kv in others:
        num_tokens, got = client.get(other_tokens)
        assert num_tokens == 32 and torch.equal(got, other_kv), "a page changed"


def test_flush_makes_leased_puts_visible_to_another_client_with_no_wait(service):
    """What the vLLM connector's saves rely on: once flush answers True, the directory holds
    the pages, so another client's lookup right after finds them (no polling)."""
    service(put_lease_bytes=LEASE_BYTES)
    writer, reader = connect(TINY), connect(TINY)
    assert writer.flush()  # nothing put yet: nothing to wait for
    assert writer.put(list(range(32)), kv_for(TINY, 32, 1)) == 32
    for round_index in range(4):
        leased(writer, NUM_PAGES)  # the put below makes no call
        tokens = list(range(9000 + 100 * round_index, 9032 + 100 * round_index))
        kv = kv_for(TINY, 32, 10 + round_index)
        assert writer.put(tokens, kv) == 32
        assert writer.flush()
        assert not writer.puts.unsettled()
        assert reader.lookup(tokens) == 32, f"round {round_index}"
        num_tokens, got = reader.get(tokens)
        assert num_tokens == 32 and torch.equal(got, kv)
    assert writer.counters["leased_pages"] >= 4 * NUM_PAGES
