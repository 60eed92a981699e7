"""A released device chunk is freed only once no live client on the node can still map it
(cluster/core/tiers/chunk_readers.py), through the CPU stand-in, whose chunks are shm files:
a file still there is an allocation not freed. Until then the chunk is retired: its bytes
count as used in the tier's budget and the node's stats. A client catches up with no call
(its process's poller); a dead client, or one the node cannot check, does not hold a chunk
forever."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import cluster.core.tiers.chunk_readers as chunk_readers
from cluster.core.geometry import DEVICE
from cluster.core.tiers.chunk_readers import RetiredChunks, pid_namespace
from cluster.core.tiers.chunks import Share, TierBudget
from cluster.core.tiers.memory import ArenaMapping, ArenaOptions, MappedArena
from tests.unit._chunk_client import hold_a_view
from tests.unit._pages import GEOMETRY, key, shm_files, unique_prefix
from tests.unit._pool_harness import run, store_put_each

SLOT_BYTES = 4096
CHILD_POLL_S = 0.05


def device_arena(prefix: str, num_slots: int = 4, budget_slots: int | None = None,
                 retired_max_s: float = 600.0) -> MappedArena:
    """One slot per chunk, so that a chunk goes back as soon as its slot is freed."""
    share = Share(TierBudget((budget_slots or num_slots) * SLOT_BYTES), "model", SLOT_BYTES)
    return MappedArena("device", num_slots * SLOT_BYTES, SLOT_BYTES,
                       ArenaOptions(shm_prefix=prefix, share=share,
                                    retired_chunk_max_s=retired_max_s))


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    assert shm_files(name) == []


def chunk_file(arena: MappedArena, chunk: int) -> str:
    return next(c.shm_path for c in arena.descriptor().device_layout.chunks if c.chunk == chunk)


def release(arena: MappedArena, slot: int) -> None:
    arena.free(slot)
    assert arena.slots.release_empty() == 1


def reaped_within(arena: MappedArena, timeout_s: float) -> bool:
    """Reap, as the node's loop does, until nothing is retired."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        arena.reap_retired()
        if arena.retired_bytes == 0:
            return True
        time.sleep(0.02)
    return False


class Client:
    """A client in a process of its own (spawned): it maps the arena and views one slot."""

    def __init__(self, arena: MappedArena, slot: int):
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=hold_a_view, daemon=True,
                                       args=(arena.descriptor(), slot, CHILD_POLL_S, child_conn))
        self.process.start()
        self.first_byte = self.ask(None)

    def ask(self, command):
        if command is not None:
            self.conn.send(command)
        assert self.conn.poll(120), "the client process did not answer"
        return self.conn.recv()

    def end(self) -> None:
        if self.process.is_alive():
            self.conn.send("exit")
        self.process.join(30)


# ---- another process --------------------------------------------------------------------------


def test_a_released_chunk_stays_allocated_while_another_process_maps_it_and_goes_once_it_lets_go(
        prefix):
    """The client makes no call after it mapped: its poller drops the released chunk's
    mapping once its view is gone and tells the node, which then frees it."""
    arena = device_arena(prefix)
    slot = arena.alloc()
    arena.view(slot).fill_(7)
    path = chunk_file(arena, 0)
    client = Client(arena, slot)
    try:
        assert client.first_byte == 7
        release(arena, slot)
        time.sleep(10 * CHILD_POLL_S)  # the client's poller has run meanwhile, several times
        assert arena.reap_retired() == 0
        assert os.path.exists(path) and arena.retired_bytes == SLOT_BYTES
        assert arena.slots.budget.retired_bytes == SLOT_BYTES
        # its poller dropped the chunk's mapping (no new copy goes through it), with no call
        assert client.ask("let go") == {}
        assert reaped_within(arena, 10.0)
        assert not os.path.exists(path) and arena.slots.budget.retired_bytes == 0
    finally:
        client.end()
        arena.close()


def test_a_client_whose_process_died_does_not_keep_a_chunk(prefix):
    arena = device_arena(prefix)
    slot = arena.alloc()
    path = chunk_file(arena, 0)
    client = Client(arena, slot)
    try:
        release(arena, slot)
        arena.reap_retired()
        assert os.path.exists(path)  # it maps it, and is alive
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.join(30)
        assert arena.reap_retired() == SLOT_BYTES and not os.path.exists(path)
        readers = arena._backing.readers
        assert readers.live_readers() == []
        assert not readers.table.slots[:, 0].any()  # its slot was cleared for the next one
    finally:
        client.end()
        arena.close()


# ---- in this process ------------------------------------------------------------------------


def test_several_releases_and_a_chunk_granted_again_while_its_old_grant_is_retired(prefix):
    arena = device_arena(prefix, num_slots=3, budget_slots=4)
    budget = arena.slots.budget
    slots = [arena.alloc() for _ in range(3)]
    mapping = ArenaMapping(arena.descriptor())
    views = {slot: mapping.view(slot) for slot in slots}  # a copy under way through each
    old = {c.chunk: (c.grant, c.shm_path) for c in arena.descriptor().device_layout.chunks}
    release(arena, slots[0])
    release(arena, slots[1])
    assert arena.retired_bytes == 2 * SLOT_BYTES == budget.retired_bytes
    assert budget.free_bytes == SLOT_BYTES  # 4 - chunk 2 held - 2 retired: not promised
    assert arena.alloc() == 0  # chunk 0 granted again: a new allocation ...
    assert arena.alloc() is None  # ... and no more: the retired ones are not free yet
    again = next(c for c in arena.descriptor().device_layout.chunks if c.chunk == 0)
    assert again.grant != old[0][0] and os.path.exists(old[0][1]) and os.path.exists(old[1][1])
    mapping.update(arena.descriptor())  # a reply: the client maps the new grant
    assert mapping.device.mapped_chunks == {0: again.grant, 2: old[2][0]}
    mapping.device.catch_up()
    assert arena.reap_retired() == 0  # both still viewed
    views.pop(slots[0])
    views.pop(slots[1])
    mapping.device.catch_up()
    assert arena.reap_retired() == 2 * SLOT_BYTES
    assert not os.path.exists(old[0][1]) and not os.path.exists(old[1][1])
    assert os.path.exists(again.shm_path) and os.path.exists(old[2][1])  # held: untouched
    assert budget.retired_bytes == 0 and arena.alloc() == 1  # room again
    arena.close()


def test_a_client_that_makes_no_call_drops_a_released_chunk_once_its_views_are_gone(prefix):
    """What the poller does, run here by hand: drop the mapping of a chunk the node no longer
    lists, and catch up once its last view is gone."""
    arena = device_arena(prefix)
    slots = [arena.alloc() for _ in range(2)]
    mapping = ArenaMapping(arena.descriptor())
    view = mapping.view(slots[0])
    release(arena, slots[0])
    version = arena.layout_version
    assert mapping.device.catch_up() < version  # still viewed
    assert mapping.view(slots[0]) is None  # dropped: no new copy goes through it
    assert mapping.view(slots[1]) is not None  # the chunk still held stays mapped
    del view
    assert mapping.device.catch_up() == version
    assert arena.reap_retired() == SLOT_BYTES
    arena.close()


def test_a_layout_older_than_a_release_never_maps_the_released_chunk(prefix):
    """A descriptor read before a release (a reply in flight) maps only what the node still
    lists: the released chunk, free to go at any time, is a miss."""
    arena = device_arena(prefix)
    slots = [arena.alloc() for _ in range(2)]
    stale = arena.descriptor()
    release(arena, slots[0])
    assert arena.retired_bytes == 0  # no client mapped it: freed at once
    mapping = ArenaMapping(stale)
    assert mapping.view(slots[0]) is None and mapping.view(slots[1]) is not None
    arena.close()


def test_closing_the_arena_frees_the_retired_chunks_too(prefix):
    arena = device_arena(prefix)
    slot = arena.alloc()
    mapping = ArenaMapping(arena.descriptor())
    view = mapping.view(slot)
    release(arena, slot)
    assert arena.retired_bytes == SLOT_BYTES
    arena.close()  # the node shuts down: everything goes, mapped or not
    assert arena.retired_bytes == 0 and arena.slots.budget.retired_bytes == 0
    assert view is not None  # (the fixture checks that no file is left)


def test_the_node_stats_count_retired_chunk_bytes_as_taken(stores):
    store = stores.make(device_pages=2)
    run(store_put_each(store, range(2)))
    descriptors = store.descriptors(GEOMETRY)
    mapping = ArenaMapping(descriptors[DEVICE])
    held = [mapping.view(slot) for slot in range(2)]
    assert all(view is not None for view in held)
    assert store.stats()["retired_chunk_bytes"] == 0
    device = store.pools[GEOMETRY].memory[DEVICE]
    assert store.discard(GEOMETRY, [key(0), key(1)]) == 2
    released = device.slots.release_empty()
    assert released >= 1
    retired = store.stats()["retired_chunk_bytes"]
    assert retired == released * device.chunk_bytes > 0
    assert device.slots.budget.free_bytes == device.slots.budget.capacity_bytes - retired
    held.clear()
    mapping.device.catch_up()
    device.reap_retired()
    assert store.stats()["retired_chunk_bytes"] == 0


# ---- clients the node cannot check, and faults --------------------------------------------------


def test_a_client_in_another_pid_namespace_keeps_a_chunk_only_until_the_timeout(prefix, caplog):
    """Its pid means nothing here: it is trusted as live, then the chunk goes anyway."""
    arena = device_arena(prefix, retired_max_s=30.0)
    slot = arena.alloc()
    readers = arena._backing.readers
    # a slot as a client in another PID namespace writes it: some pid, its namespace, behind
    readers.table.slots[5] = (os.getpid() + 1_000_000, pid_namespace() + 1, 0, 0)
    release(arena, slot)
    assert arena.retired_bytes == SLOT_BYTES
    assert [r.checked for r in readers.live_readers()] == [False]  # never cleared as dead
    now_s = time.monotonic()
    assert arena.reap_retired(now_s + 29.0) == 0
    with caplog.at_level(logging.WARNING, logger="raykv.tiers"):
        assert arena.reap_retired(now_s + 31.0) == SLOT_BYTES
    assert "another PID namespace" in caplog.text and "retired_chunk_max_s" in caplog.text
    arena.close()


def test_retired_chunks_wait_for_every_live_reader_and_not_for_dead_ones(prefix):
    """RetiredChunks on its own: a chunk goes once every live slot reached its version."""
    arena = device_arena(prefix)
    readers = arena._backing.readers
    retired = RetiredChunks(readers, max_s=600.0)
    me = os.getpid()
    start = chunk_readers._proc_stat(me)[1]
    readers.table.slots[0] = (me, pid_namespace(), start, 3)
    readers.table.slots[1] = (2**31 - 7, pid_namespace(), 0, 0)  # no such process
    retired.add("a", 10, 3, 0.0)
    retired.add("b", 20, 4, 0.0)
    assert retired.due(1.0) == ["a"] and retired.retired_bytes == 20
    assert not readers.table.slots[1].any()  # the dead one's slot was cleared
    readers.table.slots[0, 3] = 4
    assert retired.due(1.0) == ["b"] and retired.retired_bytes == 0
    readers.table.slots[0] = 0
    arena.close()


def test_a_client_without_a_slot_maps_nothing_and_misses(prefix):
    """A full table (or a readers file it cannot open): no mapping, no error; its reads
    miss."""
    arena = device_arena(prefix)
    slot = arena.alloc()
    slots = arena._backing.readers.table.slots
    slots[:, :3] = (os.getpid(), pid_namespace(), chunk_readers._proc_stat(os.getpid())[1])
    # every slot taken, by live clients
    full = ArenaMapping(arena.descriptor())
    assert full.view(slot) is None and full.device.mapped_chunks == {}
    slots[7, 0] = 2**31 - 7  # a client gone (the node clears such slots only as it reaps)
    assert ArenaMapping(arena.descriptor()).view(slot) is not None  # its slot is reused
    assert int(slots[7, 0]) == os.getpid()
    slots[:] = 0
    descriptor = arena.descriptor()
    os.unlink(descriptor.device_layout.readers_path)  # gone: cannot be opened
    assert ArenaMapping(descriptor).view(slot) is None
    arena.close()


def test_the_slot_table_of_a_client_process_is_its_own(prefix):
    """A client's slot holds its pid, PID namespace and start time, and is given back once
    its mappings are gone."""
    arena = device_arena(prefix)
    arena.alloc()
    mapping = ArenaMapping(arena.descriptor())
    slots = arena._backing.readers.table.slots
    taken = np.flatnonzero(slots[:, 0])
    assert len(taken) == 1
    pid, namespace, start, _ = (int(word) for word in slots[taken[0]])
    assert (pid, namespace, start) == (os.getpid(), pid_namespace(),
                                       chunk_readers._proc_stat(os.getpid())[1])
    reader = mapping.device._slot
    del mapping
    assert reader.poll() is False and not slots[:, 0].any()
    arena.close()
