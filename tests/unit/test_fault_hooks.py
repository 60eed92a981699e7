"""The test-only fault hooks (cluster/core/faults.py), pure: a full disk degrades a store's
puts to dropped demotions (the store lives, nothing leaks), a slow disk is slow and still
byte-exact, and lost and reordered event batches still leave the directory with exactly what
the node holds."""

from __future__ import annotations

import errno
import random
import time

import numpy as np
import pytest

from cluster.core.events import APPLIED
from cluster.core.faults import DiskFaults, EventFaults, NodeFaults, apply_fault
from tests.unit._pages import GEOMETRY, page_bytes
from tests.unit._pages import key as page_key
from tests.unit._pool_harness import run, store_put, store_put_each, tiers
from tests.unit.test_events import Link, key

G = GEOMETRY


def test_faults_are_off_until_injected_and_clear_turns_them_off():
    faults = NodeFaults()
    assert faults.describe() == {"disk": None, "events": None}
    apply_fault(faults, "slow_disk", {"delay_s": 0.01})
    apply_fault(faults, "full_disk", {})
    assert faults.disk == DiskFaults(0.01, errno.ENOSPC)  # both at once
    apply_fault(faults, "event_batches", {"drop_fraction": 0.5, "reorder": True})
    assert faults.describe()["events"]["drop_fraction"] == 0.5
    apply_fault(faults, "clear", {})
    assert faults.describe() == {"disk": None, "events": None}


@pytest.mark.parametrize(("kind", "params", "error"), [
    ("melt_cpu", {}, ValueError), ("slow_disk", {"delay_s": 0}, ValueError),
    ("full_disk", {"errno": errno.EPERM}, ValueError),
    ("event_batches", {"drop_fraction": 1.0}, ValueError),
    ("slow_disk", {"latency": 1}, TypeError)])
def test_bad_faults_are_refused(kind, params, error):
    with pytest.raises(error):
        apply_fault(NodeFaults(), kind, params)


def test_a_full_disk_drops_demoted_pages_and_the_store_keeps_serving(stores):
    store = stores.make()  # 2 device + 2 host pages in memory, 3 on disk
    store.pool(G)
    store.set_disk_faults(DiskFaults(write_errno=errno.ENOSPC))
    run(store_put_each(store, range(8)))  # every put stored, though nothing reaches disk
    pool = store.pool(G)
    assert tiers(pool)["disk"] == [] and pool.disk.num_used == 0  # no slot leaked
    assert sorted(tiers(pool)["device"] + tiers(pool)["host"]) == [4, 5, 6, 7]
    store.set_disk_faults(None)
    assert run(store_put(store, [8])) == 1
    assert tiers(pool)["disk"] == [4]  # the disk works again


def test_a_slow_disk_is_slower_and_still_byte_exact(stores):
    store = stores.make()
    run(store_put_each(store, range(5)))  # page 0 on disk
    store.set_disk_faults(DiskFaults(delay_s=0.05))
    started_s = time.monotonic()
    pages = run(store.map_pages(G, [page_key(0)], np.copy))
    assert time.monotonic() - started_s >= 0.05
    assert np.array_equal(pages[0], page_bytes(0).numpy())


def test_new_pools_get_the_faults_too(stores):
    store = stores.make()
    faults = DiskFaults(delay_s=0.01)
    store.set_disk_faults(faults)
    assert store.pool(G).disk.faults is faults


def mangled(faults: EventFaults, link: Link):
    """A delivery that loses and reorders batches as the node actor's hook does."""

    def deliver(outgoing):
        sent, timed_out, vanished = faults.mangle(outgoing)
        for index, _ in timed_out:
            link.stream.on_failure(index)
        for index, batch in vanished:
            link.stream.on_status(index, batch.seq, APPLIED)
        return sent

    return deliver


@pytest.mark.parametrize("seed", range(8))
def test_lost_and_reordered_batches_converge_once_the_link_heals(seed):
    rng = random.Random(seed)
    link = Link(num_shards=2)
    faults = EventFaults(0.4, True, random.Random(seed))
    deliver = mangled(faults, link)
    for step in range(200):
        link.change(rng.randrange(60), rng.choice([0, 1, 2, None]))
        link.flush(heartbeat=step % 5 == 0, deliver=deliver)
    assert faults.counters["vanished"] > 0 and faults.counters["timed_out"] > 0
    for _ in range(4):  # healed: a few heartbeats repair what was lost
        link.flush(heartbeat=True)
    assert link.directory_view() == link.held
    assert all(shard.stats()["waiting_batches"] == 0 for shard in link.shards)


def test_a_vanished_batch_alone_is_repaired_by_the_next_heartbeat():
    link = Link()
    link.flush()
    link.change(1, 0)
    faults = EventFaults(0.999, False, random.Random(3))
    while not faults.counters["vanished"]:  # lose batches until one vanished for good
        link.flush(deliver=mangled(faults, link))
        link.change(1, 0)
    link.flush(heartbeat=True)
    link.flush(heartbeat=True)
    assert link.directory_view() == {key(1): 0}
