"""Demotion ahead of need (cluster/core/demote_ahead.py): the host headroom is learned from
batches that found the tier full, kept free between requests, and a read-up from disk that
fits it writes nothing on its own path. Pure asyncio pools, no Ray."""

from __future__ import annotations

import asyncio
import errno
import time

import torch

from cluster.core.demote_ahead import MAX_FRACTION, WINDOW_S, RecentPeak
from cluster.core.faults import DiskFaults
from cluster.core.geometry import DEVICE, HOST
from cluster.core.pool_entry import State
from cluster.core.pool_moves import DISK_RETRY_S
from cluster.core.store import NodeStore
from tests.unit._pages import key, page
from tests.unit._pool_harness import (
    assert_slots_consistent,
    put,
    put_each,
    read,
    run,
    store_put,
    store_put_each,
    tiers,
)


def test_recent_peak_keeps_the_largest_batch_while_batches_like_it_come():
    peak = RecentPeak(window_s=10.0)
    assert peak.value(0.0) == 0
    peak.note(4, 0.0)
    peak.note(1, 5.0)  # smaller than half: does not keep the peak alive
    assert peak.value(9.0) == 4 and peak.value(10.5) == 0
    peak.note(3, 9.0)  # at least half the peak: it stays in mind
    assert peak.value(18.0) == 4
    assert peak.value(19.5) == 0
    peak.note(2, 30.0)  # the old peak expired: a new, smaller one
    assert peak.value(30.0) == 2
    peak.note(6, 31.0)
    assert peak.value(31.0) == 6


def test_a_tier_that_is_not_full_keeps_nothing_free(harness):
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16)
    run(put_each(pool, range(8)))  # each put fit in free room
    assert pool.headroom_pages() == 0
    assert run(pool.demote_ahead()) == 0
    assert tiers(pool)["host"] == list(range(8))


def test_a_read_up_that_fits_the_headroom_writes_nothing_on_its_path(harness):
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(8)))
    run(put(pool, [8, 9, 10, 11]))  # a batch of 4 into a full host: it leaned, and waited
    assert tiers(pool)["disk"] == [0, 1, 2, 3]
    cap = int(8 * MAX_FRACTION)
    assert pool.headroom_pages() == cap  # the peak (4), capped at a quarter of the tier
    assert run(pool.demote_ahead()) == cap  # between requests: the coldest host pages
    assert tiers(pool)["disk"] == [0, 1, 2, 3, 4, 5]
    assert pool.demoted_ahead == cap and run(pool.demote_ahead()) == 0
    written = pool.disk.bytes_written
    run(pool.load_from_disk([key(0), key(1)]))  # fits the free room
    assert pool.disk.bytes_written == written  # no demotion write on the read's path
    assert tiers(pool)["host"] == [0, 1, 6, 7, 8, 9, 10, 11]
    for i in range(12):
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


def test_the_counters_move_together_while_the_demotion_writes_run(harness):
    """Stats read while demotion ahead writes to disk see its pages both as host evictions
    and as demoted ahead (a cluster test compares the two across a read-up)."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(8)))
    run(put(pool, [8, 9, 10, 11]))
    evicted, seen = pool.evictions[HOST], []
    move_down = pool._move_down

    async def watched(keys, below, pins, keep_unmoved):
        seen.append((pool.evictions[HOST] - evicted, pool.demoted_ahead))
        return await move_down(keys, below, pins, keep_unmoved)

    pool._move_down = watched
    assert run(pool.demote_ahead()) == 2
    assert seen == [(2, 2)]


def test_the_headroom_is_forgotten_when_such_batches_stop(harness):
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16)
    run(put_each(pool, range(8)))
    run(put(pool, [8]))
    assert pool.headroom_pages() == 1
    assert pool.headroom_pages(time.monotonic() + WINDOW_S + 1) == 0


def test_without_a_disk_tier_nothing_is_demoted_ahead(harness):
    pool = harness.make(device_pages=0, host_pages=4, disk_pages=0)
    run(put_each(pool, range(6)))  # the last two leaned; their victims were dropped
    assert pool.headroom_pages() == 0 and run(pool.demote_ahead()) == 0


def test_a_pinned_page_is_never_demoted_ahead(harness):
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(10)))  # pages 0, 1 to disk; the peak is 1
    pool.index[key(2)].pins += 1  # a reader holds the coldest host page
    assert run(pool.demote_ahead()) == 1
    assert tiers(pool)["disk"] == [0, 1, 3]
    pool.index[key(2)].pins -= 1


def test_the_store_reports_the_headroom_and_the_pages_demoted_ahead(stores):
    store: NodeStore = stores.make(device_pages=0, host_pages=8, disk_pages=16)
    run(store_put_each(store, range(8)))
    run(store_put(store, [8, 9]))
    assert store.stats()["host_headroom_pages"] == 2
    assert store.stats()["host_headroom_short_pages"] == 2
    assert run(store.demote_ahead()) == 2
    stats = store.stats()
    assert stats["demoted_ahead_pages"] == 2 and stats["pages"]["host"] == 6
    assert stats["host_headroom_short_pages"] == 0


def test_slots_leased_to_puts_count_as_room(harness):
    """A batch takes unused leased slots back before it demotes anything, so the headroom
    counts them: the lease and the headroom share one reserve of room, not two."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(8)))
    run(put(pool, [8, 9]))  # leaned: the headroom is 2
    pool.lease_counter = lambda _pool, _tier: 2  # two unwritten leased slots
    assert pool.headroom_pages() == 2 and pool.headroom_short() == 0
    assert run(pool.demote_ahead()) == 0
    pool.lease_counter = lambda _pool, _tier: 1
    assert run(pool.demote_ahead()) == 1


def test_a_lease_top_up_that_finds_the_host_full_gets_room_kept_for_it(harness):
    """A lease never demotes a page on its call's path, but its shortfall is a batch that
    found the tier full: the node's loop then keeps that room free, and the next top-up gets
    it. Before, a full host tier leased nothing again, and every put reserved (two calls,
    its room made on its own path)."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(8)))  # full, each put fit: no headroom learned
    assert pool.headroom_pages() == 0
    assert pool.lease_free(HOST, 2) == []  # nothing demoted for it on this path
    assert tiers(pool)["disk"] == []
    assert pool.headroom_pages() == 2
    assert run(pool.demote_ahead()) == 2  # between requests: the two coldest
    assert tiers(pool)["disk"] == [0, 1]
    leased = pool.lease_free(HOST, 2)
    assert len(leased) == 2 and all(tier == HOST for tier, _ in leased)
    stored = {e.slot for e in pool.index.values() if e.tier == HOST}
    assert not stored & {slot for _, slot in leased}  # free slots, no stored page's
    pool.release_leased(sorted(leased))
    assert_slots_consistent(pool)


def test_without_a_disk_tier_a_short_lease_demotes_nothing(harness):
    pool = harness.make(device_pages=0, host_pages=4, disk_pages=0)
    run(put_each(pool, range(4)))
    assert pool.lease_free(HOST, 2) == []
    assert pool.headroom_pages() == 0 and run(pool.demote_ahead()) == 0
    assert tiers(pool)["host"] == [0, 1, 2, 3]


def _full_host_with_headroom(harness):
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(8)))
    run(put(pool, [8, 9, 10, 11]))  # leaned on the host: 2 pages are to be kept free
    assert pool.headroom_short() == 2
    return pool


def test_a_disk_that_fails_its_writes_costs_no_page_for_headroom(harness):
    """Room kept ahead is not worth a page: the victims the disk refuses stay in host, and
    the loop waits DISK_RETRY_S before it tries again (it used to drop them, pass after
    pass)."""
    pool = _full_host_with_headroom(harness)
    host, evicted = tiers(pool)["host"], pool.evictions[HOST]
    pool.disk.faults = DiskFaults(write_errno=errno.ENOSPC)
    assert run(pool.demote_ahead()) == 0
    assert tiers(pool)["host"] == host and pool.demoted_ahead == 0
    assert pool.evictions[HOST] == evicted  # nothing left the tier
    assert pool.disk_failing() and pool.disk_retry_s > time.monotonic() + DISK_RETRY_S - 1
    pool.disk.faults = None
    assert run(pool.demote_ahead()) == 0  # within DISK_RETRY_S: no pass, however short
    pool.disk_retry_s = 0.0  # DISK_RETRY_S later
    assert run(pool.demote_ahead()) == 2 and pool.demoted_ahead == 2
    for i in range(4, 12):
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


def test_a_read_up_no_request_waits_on_drops_nothing_when_the_disk_fails_writes(harness):
    """A touch's or a prefetch's read-up: its pages are safe on disk, so it takes room only
    where the victims can be written; a read-up for an acquire still makes its room."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(12)))  # 0-3 on disk, 4-11 in host
    pool.disk.faults = DiskFaults(write_errno=errno.ENOSPC)
    run(pool.load_from_disk([key(0), key(1)], keep_unmoved=True))
    assert tiers(pool)["host"] == list(range(4, 12)) and tiers(pool)["disk"] == [0, 1, 2, 3]
    run(pool.load_from_disk([key(2)]))  # an acquire's: the coldest host page is dropped
    assert sorted(tiers(pool)["host"]) == [2, *range(5, 12)] and 4 not in tiers(pool)["disk"]
    pool.disk.faults = None
    run(pool.load_from_disk([key(0), key(1)], keep_unmoved=True))  # the disk takes victims
    assert sorted(tiers(pool)["host"]) == [0, 1, 2, 7, 8, 9, 10, 11]
    for i in [0, 1, 2, 3, *range(5, 12)]:
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


def test_a_failing_disk_loses_no_disk_page_to_make_room_for_writes(harness):
    """Puts into a full host over a full disk that fails its writes: each put is stored (host
    victims are dropped for it), and no disk page is evicted for writes that would fail; once
    a write lands again, the disk takes pages as always."""
    pool = harness.make(device_pages=0, host_pages=4, disk_pages=4, eviction="lru")
    run(put_each(pool, range(8)))  # 0-3 on disk (full), 4-7 in host (full)
    assert tiers(pool)["disk"] == [0, 1, 2, 3]
    pool.disk.faults = DiskFaults(write_errno=errno.EIO)
    run(put(pool, [8]))  # the first write fails: the disk had evicted page 0 for it
    assert pool.disk_failing() and tiers(pool)["disk"] == [1, 2, 3]
    run(put(pool, [9, 10]))  # two victims, one free disk slot: none evicted for the other
    assert tiers(pool)["disk"] == [1, 2, 3]
    assert {8, 9, 10} <= set(tiers(pool)["host"])  # every put stored
    pool.disk.faults = None
    pool.disk_retry_s = 0.0  # DISK_RETRY_S later
    run(put(pool, [11]))
    assert not pool.disk_failing() and len(tiers(pool)["disk"]) == 4  # the disk takes pages
    for i in tiers(pool)["host"]:
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


async def until_moving(pool, tier: int) -> None:
    """Until a page of `tier` is MOVING (a move's victims, their writes under way)."""
    while not any(e.state == State.MOVING and e.tier == tier for e in pool.index.values()):
        await asyncio.sleep(0.001)


def test_a_put_during_a_read_up_into_a_full_host_over_a_failing_disk_is_stored_whole(harness):
    """A touch's read-up of many disk pages marks as many host victims MOVING while their
    writes to a failing disk run; a put reserving meanwhile found almost no victims left and
    stored part of its prompt (CI: "32 of 64 tokens stored"). Room is made under the pool's
    room lock, so the put's room is made after the read-up's, from every host page."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(14)))  # 0-5 on disk, 6-13 in host (full)
    pool.disk.faults = DiskFaults(delay_s=0.05, write_errno=errno.ENOSPC)

    async def read_up_then_put() -> int:
        reading = asyncio.ensure_future(
            pool.load_from_disk([key(i) for i in range(6)], keep_unmoved=True))
        await until_moving(pool, HOST)  # the read-up's victims are on their way to disk
        stored = await put(pool, [20, 21, 22, 23])
        await reading
        return stored

    assert run(read_up_then_put()) == 4
    assert {20, 21, 22, 23} <= set(tiers(pool)["host"])
    assert tiers(pool)["disk"] == list(range(6))  # the read-up's pages stayed, none lost
    pool.disk.faults = None
    pool.disk_retry_s = 0.0  # DISK_RETRY_S later: reads up demote to disk, dropping nothing
    for i in [20, 21, 22, 23, *range(6)]:
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


def test_a_put_during_a_promotion_over_a_failing_disk_is_stored_whole(harness):
    """A promotion marks its host pages and the device victims MOVING while the victims'
    writes run: a put reserving meanwhile found no victim in either memory tier. It now
    makes its room after the promotion's."""
    pool = harness.make(device_pages=4, host_pages=4, disk_pages=16, eviction="lru")
    run(put_each(pool, range(12)))  # 0-3 on disk, 4-7 in host, 8-11 in the device tier
    pool.disk.faults = DiskFaults(delay_s=0.05, write_errno=errno.ENOSPC)

    async def promote_then_put() -> int:
        promoting = asyncio.ensure_future(pool.promote_many([key(i) for i in range(4, 8)]))
        await until_moving(pool, DEVICE)
        stored = await put(pool, [20, 21, 22, 23])
        await promoting
        return stored

    assert run(promote_then_put()) == 4
    assert {20, 21, 22, 23} <= set(tiers(pool)["device"])
    for i in [20, 21, 22, 23]:
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


def test_a_lease_top_up_takes_none_of_the_room_a_read_up_is_making(harness):
    """A read-up into a full host frees its room by demoting victims, then places its pages.
    A lease top-up between the two took the freed slots, and the read-up placed part of its
    pages (CI on 5761892: a prefetch left one page of two on disk for good, 3 pages in the
    host's 4 slots). Room made under the pool's room lock belongs to whoever made it: a lease
    takes free slots only when no one is making room."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(12)))  # 0-3 on disk, 4-11 in host (full)
    pool.disk.faults = DiskFaults(delay_s=0.05)  # slow, not failing: the victims go down

    async def read_up_beside_a_top_up() -> list:
        reading = asyncio.ensure_future(
            pool.load_from_disk([key(i) for i in range(2)], keep_unmoved=True))
        leased: list = []
        while not reading.done():
            if pool._free_slots(HOST) > 0:  # the victims' slots, freed before the placing
                leased += pool.lease_free(HOST, 2)
            await asyncio.sleep(0)
        await reading
        return leased

    assert run(read_up_beside_a_top_up()) == []
    assert {0, 1} <= set(tiers(pool)["host"])  # both pages read up, none left on disk
    assert pool.lease_free(HOST, 2) == []  # afterwards: the host is full again, as before
    assert_slots_consistent(pool)


def test_a_top_up_turned_away_by_a_room_maker_is_not_noted_as_a_full_tier(harness):
    """A top-up that finds the room lock held comes back empty without noting a short lease:
    the tier was busy, not found full, and noting it would widen the kept headroom for a
    batch that never came. A top-up that finds the tier full is noted."""
    pool = harness.make(device_pages=0, host_pages=8, disk_pages=16, eviction="lru")
    run(put_each(pool, range(8)))  # host full

    async def top_up_while_locked() -> list:
        async with pool.room_lock:
            return pool.lease_free(HOST, 5)

    assert run(top_up_while_locked()) == []
    assert pool.host_peak.pages == 0
    assert pool.lease_free(HOST, 5) == [] and pool.host_peak.pages == 5
