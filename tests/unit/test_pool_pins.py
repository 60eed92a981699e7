"""Pool pins, reservations and concurrent puts: a pinned page is never evicted, reserved pages
stay invisible until committed, and puts spill or shorten under pressure. Pure asyncio."""

from __future__ import annotations

import asyncio

from cluster.core.geometry import DEVICE, HOST
from cluster.core.pool import State
from tests.unit._pages import as_page, key, page
from tests.unit._pool_harness import (
    assert_slots_consistent,
    new_owner,
    put_each,
    run,
    tiers,
)

# ---- pins ------------------------------------------------------------------------------


def test_a_pinned_page_is_never_evicted(harness):
    pool = harness.make()

    async def scenario():
        await put_each(pool, [0])
        located = await pool.acquire([key(0)])
        assert located == [(DEVICE, 0, pool.memory[DEVICE].generation(0))]
        await put_each(pool, range(1, 12))
        return located

    (tier, slot, _), = run(scenario())
    entry = pool.index[key(0)]
    assert (entry.tier, entry.slot, entry.pins) == (DEVICE, slot, 1)
    assert as_page(pool.memory[DEVICE].view(slot)).equal(page(0))
    others = [(e.tier, e.slot) for k, e in pool.index.items() if k != key(0)]
    assert (DEVICE, slot) not in others
    assert tiers(pool)["device"] == [0, 11]
    assert (key(0), None) not in harness.events
    assert_slots_consistent(pool)


def test_after_release_a_page_can_be_evicted(harness):
    pool = harness.make()

    async def scenario():
        await put_each(pool, [0])
        await pool.acquire([key(0)])
        await put_each(pool, range(1, 4))
        assert pool.index[key(0)].tier == DEVICE
        pool.release([key(0)])
        await put_each(pool, range(4, 10))

    run(scenario())
    assert key(0) not in pool.index
    assert (key(0), None) in harness.events


def test_pinned_host_page_is_not_demoted_to_disk(harness):
    pool = harness.make(device_pages=0, host_pages=2)

    async def scenario():
        await put_each(pool, [0])
        assert await pool.acquire([key(0)]) == [(HOST, 0, pool.memory[HOST].generation(0))]
        await put_each(pool, range(1, 8))

    run(scenario())
    assert pool.index[key(0)].tier == HOST and pool.index[key(0)].slot == 0
    assert as_page(pool.memory[HOST].view(0)).equal(page(0))


def test_reserve_spills_below_a_pinned_top_tier(harness):
    pool = harness.make()

    async def scenario():
        await put_each(pool, [0, 1])
        assert len(await pool.acquire([key(0), key(1)])) == 2
        return await pool.reserve([key(2)], new_owner())

    assert run(scenario()) == [(1, pool.index[key(2)].slot)]
    assert pool.index[key(2)].tier == 1


def test_reserve_returns_empty_when_everything_is_pinned(harness):
    pool = harness.make(host_pages=0)

    async def scenario():
        await put_each(pool, [0, 1])
        assert len(await pool.acquire([key(0), key(1)])) == 2
        return await pool.reserve([key(2)], new_owner())

    assert run(scenario()) == []
    assert key(2) not in pool.index
    assert tiers(pool) == {"device": [0, 1], "host": [], "disk": []}


def test_reserve_more_pages_than_memory_holds_keeps_the_prefix_that_fits(harness):
    pool = harness.make()
    reserved = run(pool.reserve([key(i) for i in range(5)], new_owner()))
    assert [tier for tier, _ in reserved] == [0, 0, 1, 1]
    assert sorted(pool.index) == sorted(key(i) for i in range(4))


def test_a_reserved_page_is_not_evicted_by_other_puts(harness):
    pool = harness.make()

    owner = new_owner()

    async def scenario():
        slots = await pool.reserve([key(0)], owner)
        await put_each(pool, range(1, 6))
        return slots

    slots = run(scenario())
    assert pool.index[key(0)].state == State.PENDING
    assert (pool.index[key(0)].tier, pool.index[key(0)].slot) == slots[0]
    assert pool.commit([key(0)], owner) == 1


# ---- reserve / commit / abort ----------------------------------------------------------


def test_reserved_pages_are_invisible_until_commit(harness):
    pool = harness.make()
    keys = [key(0), key(1)]
    owner = new_owner()
    slots = run(pool.reserve(keys, owner))
    assert sorted(slots) == [(DEVICE, 0), (DEVICE, 1)]
    assert pool.local_prefix(keys) == 0
    assert run(pool.acquire(keys)) == []
    assert pool.tier_counts() == {"device": 0, "host": 0, "disk": 0}
    assert harness.events == []
    assert pool.commit(keys, owner) == 2
    assert pool.commit(keys, owner) == 0  # already committed
    assert pool.local_prefix(keys) == 2
    assert harness.events == [(key(0), DEVICE), (key(1), DEVICE)]


def test_abort_frees_reserved_slots(harness):
    pool = harness.make()
    run(put_each(pool, [9]))
    harness.events.clear()
    keys = [key(0), key(1)]
    owner = new_owner()
    assert len(run(pool.reserve(keys, owner))) == 2
    assert pool.memory[DEVICE].slots.num_free == 0
    assert pool.index[key(9)].tier == HOST  # demoted to make room
    pool.abort(keys, new_owner())  # another owner's abort leaves them reserved
    assert pool.memory[DEVICE].slots.num_free == 0
    assert all(pool.index[k].state == State.PENDING for k in keys)
    pool.abort(keys + [key(9)], owner)  # a committed page is not aborted
    assert pool.memory[DEVICE].slots.num_free == 2
    assert set(pool.index) == {key(9)}
    assert pool.commit(keys, owner) == 0
    assert pool.local_prefix(keys) == 0
    assert harness.events == [(key(9), HOST)]  # the demotion only: nothing was stored
    assert_slots_consistent(pool)


def test_reserve_dedups_stored_keys(harness):
    pool = harness.make()
    run(put_each(pool, [0]))
    owner = new_owner()
    slots = run(pool.reserve([key(0), key(1)], owner))
    assert slots[0] is None
    assert slots[1] == (DEVICE, 1)
    assert run(pool.reserve([key(0)], new_owner())) == [None]
    # a page another put holds reserved is not stored yet: the prefix stops there
    assert run(pool.reserve([key(1)], new_owner())) == []
    assert run(pool.reserve([key(0), key(1)], new_owner())) == [None]
    assert pool.index[key(1)].owner == owner
    assert pool.commit([key(0), key(1)], new_owner()) == 0  # not another owner's to commit
    assert pool.commit([key(0), key(1)], owner) == 1


def test_concurrent_reserves_of_one_key_get_one_slot(harness):
    pool = harness.make()

    owners = [new_owner(), new_owner()]

    async def scenario():
        await put_each(pool, range(4))  # device and host full: room needs a disk write
        return await asyncio.gather(*(pool.reserve([key(9)], owner) for owner in owners))

    results = run(scenario())
    winner = pool.index[key(9)].owner
    loser = owners[1 - owners.index(winner)]
    # one slot: the other put finds the key pending under the winner, not stored
    assert results[owners.index(winner)] == [(DEVICE, pool.index[key(9)].slot)]
    assert results[owners.index(loser)] == []
    assert pool.index[key(9)].state == State.PENDING
    assert pool.commit([key(9)], loser) == 0
    assert pool.commit([key(9)], winner) == 1
    assert_slots_consistent(pool)


# ---- shared in-flight loads, prefetch-style promotion, corruption ----------------------
