"""Writers that stall past their reservation's lease: a client's copy into shared memory, and
the node's own pull from another node. The late bytes must never land in a slot that another
put was given meanwhile (cluster/core/tiers/fence.py: slot write locks and quarantine)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from cluster.core.dataplane.auth import Authority
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.pull import pull_pages
from tests.unit._fakes import drive
from tests.unit._pages import GEOMETRY as G
from tests.unit._pages import key, page_bytes
from tests.unit._pool_harness import store_put
from tests.unit.test_fetch import KV, TOKENS, client_of, world  # noqa: F401 (a fixture)

FAR_FUTURE_S = 1e9
_HOLDER = """
import mmap, os, sys, time
from cluster.core.tiers.fence import SlotFence
gen_path, shm_path, slot, slot_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fence = SlotFence(gen_path)
assert fence.lock([slot])
print("locked", flush=True)
sys.stdin.readline()  # the late copy starts when told (the process may be stopped first)
fd = os.open(shm_path, os.O_RDWR)
slab = mmap.mmap(fd, os.fstat(fd).st_size)
slab[slot * slot_bytes : slot * slot_bytes + 64] = b"\\xee" * 64
print("wrote", flush=True)
sys.stdin.readline()
"""


def _read(store, ids: list[int]) -> list[np.ndarray]:
    """Each page's bytes, read one at a time (a read pins no more than memory holds)."""
    pages = [asyncio.run(store.map_pages(G, [key(i)], np.copy)) for i in ids]
    assert all(len(found) == 1 for found in pages), "a page went missing"
    return [found[0] for found in pages]


def test_a_put_whose_reservation_lapsed_before_its_copy_writes_nothing(world):  # noqa: F811
    """The client's copy runs after the node let its slots go and another put took one: it
    must write nothing (its slot's generation moved), and report nothing stored."""
    client = client_of(world)
    other = torch.full((G.page_bytes,), 7, dtype=torch.uint8)

    def lapse_and_reuse() -> None:
        for place in world.local.reserved.values():
            arena = world.arenas[place[0]]
            arena.free(place[1])  # expiry (the generation moves) ...
            assert arena.alloc() == place[1]  # ... and another put's reserve
            arena.view(place[1])[: G.page_bytes].copy_(other)

    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    stored = drive(client._put(TOKENS, kv), lapse_and_reuse)
    for place in world.local.reserved.values():
        assert torch.equal(world.arenas[place[0]].view(place[1])[: G.page_bytes], other), \
            "the late copy overwrote another put's page"
    assert stored == 0


class _StalledTransport:
    """A pull's receive that blocks until released, then lands its bytes (0xEE)."""

    name = "stalled"

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def read(self, reads, timeout_s: float) -> list[int | None]:
        self.started.set()
        self.go.wait(30)
        for read in reads:
            for dest in read.dests:
                for buffer in dest:
                    np.frombuffer(buffer, dtype=np.uint8)[:] = 0xEE
        return [len(read.keys) for read in reads]


def test_a_pull_whose_receive_outlives_its_lease_overwrites_no_other_page(stores):
    store = stores.make(device_pages=0, host_pages=4, disk_pages=8)
    transport = _StalledTransport()
    endpoint = Endpoint("stalled", "127.0.0.1", 1, 1)

    async def scenario() -> int | None:
        pulling = asyncio.ensure_future(
            pull_pages(store, transport, endpoint,
                       (G, [key(50)], "", Authority.of_node(b"p" * 32, b"n" * 32)), 5.0))
        await asyncio.to_thread(transport.started.wait, 10)
        assert store.expire(FAR_FUTURE_S) == 1  # the pull's reservation lapses mid-receive
        for i in range(6):  # more pages than the host tier holds: every free slot reused
            assert await store_put(store, [i]) == 1
        transport.go.set()
        return await pulling

    pulled = asyncio.run(scenario())
    for i, got in enumerate(_read(store, list(range(6)))):
        assert np.array_equal(got, page_bytes(i).numpy()), f"page {i} changed"
    assert pulled == 0  # its commit came too late: nothing pulled
    assert key(50) not in store.pool(G).index
    store.expire()
    assert store.stats()["quarantined_slots"] == 0  # the slot went back after the receive


def test_a_slot_a_stopped_writer_process_holds_is_quarantined_until_it_is_done(stores):
    """A real process locks a reserved slot (as a client's copy does), is SIGSTOPped past
    the lease, and writes when resumed: the slot is not reused meanwhile, the late bytes
    land in it alone, and it goes back once the writer is done."""
    store = stores.make(device_pages=0, host_pages=3, disk_pages=8)
    _, [(tier, slot)] = asyncio.run(store.reserve(G, [key(50)]))
    descriptor = store.descriptors(G)[tier]
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, descriptor.generations_path, descriptor.shm_path,
         str(slot), str(descriptor.slot_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGSTOP)
        assert store.expire(FAR_FUTURE_S) == 1
        assert store.stats()["quarantined_slots"] == 1
        for i in range(4):  # the other two slots, then demotions: never the held one
            assert asyncio.run(store_put(store, [i])) == 1
            assert all(store.pool(G).index[key(j)].slot != slot
                       for j in range(i + 1) if store.pool(G).index[key(j)].tier == tier)
        holder.send_signal(signal.SIGCONT)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "wrote"
        store.expire()
        assert store.stats()["quarantined_slots"] == 1  # its lock is still held
    finally:
        holder.kill()  # the kernel drops a dead process's locks
        holder.wait(10)
    deadline_s = time.monotonic() + 5
    while store.stats()["quarantined_slots"] and time.monotonic() < deadline_s:
        store.expire()
        time.sleep(0.05)
    assert store.stats()["quarantined_slots"] == 0
    assert store.stats()["quarantine_freed_slots"] == 1
    for i, got in enumerate(_read(store, list(range(4)))):
        assert np.array_equal(got, page_bytes(i).numpy()), f"page {i} changed"
