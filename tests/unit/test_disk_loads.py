"""Reading pages up from the disk tier into host (cluster/core/disk_loads.py): a read-up that
is cancelled while its disk read is in flight. The read runs in a thread, which a cancel does
not stop: the host slots it reads into are given back once it has landed, never before (a
slot handed to another page meanwhile would take the late read's bytes). NodeStore on tiny
tiers; pure asyncio, no Ray."""

from __future__ import annotations

import asyncio
import threading

from cluster.core.geometry import DISK, HOST
from tests.unit._pool_harness import run
from tests.unit.test_elastic import SMALL, elastic_store, key, put


def test_a_cancelled_read_up_gives_its_host_slots_back_once_its_read_landed(stores):
    store = elastic_store(stores, host_pages=16, disk_pages=32)
    assert put(store, SMALL, range(16)) == 16
    assert put(store, SMALL, range(16, 20)) == 4  # the 4 oldest go down to disk
    pool = store.pool(SMALL)
    on_disk = [k for k, e in pool.index.items() if e.tier == DISK]
    in_host = [k for k, e in pool.index.items() if e.tier == HOST]
    assert len(on_disk) == 4
    for k in in_host[:4]:
        pool.drop(k)  # room in host: the read-up reads straight into free slots
    free_before = pool._free_slots(HOST)
    entered, release = threading.Event(), threading.Event()
    read_pages = pool.disk.read_pages

    def slow_read(slots, outs):
        entered.set()
        release.wait(10)
        return read_pages(slots, outs)

    pool.disk.read_pages = slow_read

    async def scenario() -> tuple[int, int]:
        task = asyncio.ensure_future(pool._read_disk_batch(on_disk, False))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while_reading = pool._free_slots(HOST)  # the read still lands in its slots
        release.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if pool._free_slots(HOST) == free_before:
                break
        return while_reading, pool._free_slots(HOST)

    while_reading, after = run(scenario())
    assert while_reading == free_before - len(on_disk)
    assert after == free_before  # given back once the read landed: no slot leaked
    assert all(pool.index[k].tier == DISK for k in on_disk)  # still on disk, a later get's
    assert key("s", 0) in pool.index
