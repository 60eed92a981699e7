"""Leased puts on the node (cluster/core/put_leases.py through NodeStore.put_leased): free slots
leased with no key, invisible until their commit; a lapsed lease's slots fenced and freed, its
late commit refused, except a slot its writer still holds (kept until it commits or lets go);
revocation passing over a slot a writer holds; and the client's side of it
(cluster/puts.py, cluster/client.py) over the fakes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import torch

from cluster import puts
from cluster.core.geometry import HOST
from cluster.core.put_leases import LeaseRequest
from cluster.core.tiers.fence import SlotFence
from cluster.puts import COMMIT_AFTER_S, LeasedPuts
from tests.unit._fakes import drive
from tests.unit._pages import GEOMETRY as G
from tests.unit._pages import as_page, key, page, page_bytes
from tests.unit._pool_harness import store_put
from tests.unit.test_fetch import KEYS, KV, PAGE_TOKENS, TOKENS, client_of, world  # noqa: F401


def ready(store, count: int) -> None:
    """Hold `count` free host slots (as far as the tier has room), as the node actor's
    grow_ahead does after each leased-put call: a lease takes only free slots of chunks
    already held."""
    arena = store.pool(G).memory[HOST]
    taken = []
    while arena.slots.num_free_held < count and (slot := arena.alloc()) is not None:
        taken.append(slot)
    for slot in taken:
        arena.free(slot)


def lease(store, want: int, lease_id: int = 0, keys=(), slots=()):
    ready(store, want)
    return asyncio.run(store.put_leased(G, LeaseRequest(lease_id, tuple(keys), tuple(slots),
                                                        want)))


def write(store, place, i: int) -> None:
    tier, slot = place[0], place[1]
    store.pool(G).memory[tier].view(slot)[: G.page_bytes].copy_(page_bytes(i))


def read(store, i: int) -> torch.Tensor | None:
    found = asyncio.run(store.map_pages(G, [key(i)], np.copy))
    return as_page(torch.from_numpy(found[0])) if found else None


def host_used(store) -> int:
    return store.pool(G).memory[HOST].slots.num_used


def test_leased_slots_are_invisible_until_committed_then_read_back(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    reply = lease(store, 2)
    assert reply.committed == [] and len(reply.places) == 2 and reply.lease_id > 0
    assert host_used(store) == 2 and store.stats()["leased_slots"] == 2
    for i, place in enumerate(reply.places):
        write(store, place, i)
    assert read(store, 0) is None and store.pool(G).local_prefix([key(0)]) == 0
    done = lease(store, 0, reply.lease_id, [key(0), key(1)], list(reply.places))
    assert done.committed == [True, True] and done.lease_id == reply.lease_id
    assert torch.equal(read(store, 0), page(0)) and torch.equal(read(store, 1), page(1))
    assert store.stats()["leased_slots"] == 0 and stores.events(store).drain() == {
        key(0): HOST, key(1): HOST}


def test_a_key_already_stored_keeps_its_page_and_the_leased_slot_goes_back(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    assert asyncio.run(store_put(store, [0])) == 1
    reply = lease(store, 1)
    write(store, reply.places[0], 9)  # other bytes under the same key
    done = lease(store, 0, reply.lease_id, [key(0)], [reply.places[0]])
    assert done.committed == [False]
    assert torch.equal(read(store, 0), page(0))
    assert host_used(store) == 1  # only the stored page
    assert store.stats()["leased_duplicates"] == 1


def test_a_slot_not_in_the_lease_is_refused(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    reply = lease(store, 1)
    other = lease(store, 1)  # another client's lease
    assert other.lease_id != reply.lease_id
    done = lease(store, 0, reply.lease_id, [key(0)], [other.places[0]])
    assert done.committed == [False] and read(store, 0) is None
    assert store.stats()["lapsed_commits"] == 1


def test_a_lapsed_lease_frees_its_slots_and_its_late_commit_is_a_miss(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0, reserve_lease_s=0.05)
    reply = lease(store, 2)
    write(store, reply.places[0], 0)
    generation = reply.places[0][2]
    assert store.expire(time.monotonic() + 1.0) == 0  # read leases and reservations only
    assert host_used(store) == 0 and store.stats()["expired_slot_leases"] == 1
    pool = store.pool(G)
    assert pool.memory[HOST].generation(reply.places[0][1]) > generation  # fenced
    late = lease(store, 1, reply.lease_id, [key(0)], [reply.places[0]])
    assert late.committed == [False] and late.lease_id != reply.lease_id
    assert read(store, 0) is None


def test_a_lapsed_lease_keeps_the_slot_its_writer_holds_and_takes_its_late_commit(stores):
    """A client stalled past its lease, holding a written slot's lock (its put returned, its
    commit is late): that slot stays its own and the late commit lands; the slot it did not
    hold is freed and told as revoked."""
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0, reserve_lease_s=0.05)
    reply = lease(store, 2)
    held, unheld = reply.places
    writer = SlotFence(store.pool(G).memory[HOST].descriptor().generations_path)
    try:
        assert writer.lock([held[1]])
        write(store, held, 20)
        store.expire(time.monotonic() + 1.0)
        stats = store.stats()
        assert host_used(store) == 1 and stats["expired_slot_leases"] == 0
        assert stats["written_leased_slots_kept"] == 1 and stats["quarantined_slots"] == 0
        late = lease(store, 0, reply.lease_id, [key(20)], [held])
        assert late.lease_id == reply.lease_id and late.committed == [True]
        assert late.revoked == [unheld] and torch.equal(read(store, 20), page(20))
    finally:
        writer.unlock([held[1]])
        writer.close()


def test_a_held_lapsed_slot_is_freed_once_its_writer_lets_go(stores):
    """A writer that dies lets its locks go (the kernel): the next expiry frees the slot."""
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0, reserve_lease_s=0.05)
    reply = lease(store, 1)
    tier, slot, generation = reply.places[0]
    writer = SlotFence(store.pool(G).memory[tier].descriptor().generations_path)
    try:
        assert writer.lock([slot])
        store.expire(time.monotonic() + 1.0)
        assert host_used(store) == 1 and store.stats()["expired_slot_leases"] == 0
    finally:
        writer.close()  # as a dead process's locks go
    store.expire(time.monotonic() + 2.0)
    assert host_used(store) == 0 and store.stats()["expired_slot_leases"] == 1
    assert store.pool(G).memory[tier].generation(slot) > generation  # fenced


def test_ending_a_lease_gives_its_uncommitted_slots_back(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    reply = lease(store, 2)
    assert store.end_put_lease(reply.lease_id) == 2 and host_used(store) == 0
    assert store.end_put_lease(reply.lease_id) == 0


def test_a_top_up_renews_the_lease_and_is_capped_by_the_tier(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0, reserve_lease_s=0.5)
    reply = lease(store, 100)
    assert len(reply.places) == 2  # a lease holds a quarter of the 8 host slots at most
    deadline_s = store.put_leases.leases[reply.lease_id].deadline_s
    time.sleep(0.01)
    more = lease(store, 1, reply.lease_id)
    assert more.lease_id == reply.lease_id and more.places == []
    assert store.put_leases.leases[reply.lease_id].deadline_s > deadline_s  # renewed
    write(store, reply.places[0], 0)
    more = lease(store, 5, reply.lease_id, [key(0)], [reply.places[0]])
    assert more.committed == [True] and len(more.places) == 1  # one committed, one more


# ---- the client over the fakes ----------------------------------------------------------


def leased_client(world, gate=None):  # noqa: F811
    """A client whose committer is driven on the fakes (no Ray)."""
    client = client_of(world, put_lease_bytes=64 * world.arenas[HOST].slot_bytes)
    world.view.puts = LeasedPuts(world.view, 64 * world.arenas[HOST].slot_bytes, 30.0,
                                 wait=lambda steps, timeout_s: drive(steps), gate=gate)
    return client


def wait_leased(client, num_slots: int) -> None:
    """Until the committer's top-up (started by a put that found too few slots) is in."""
    deadline_s = time.monotonic() + 5.0
    while len(client.puts.pool.free) < num_slots:
        assert time.monotonic() < deadline_s, "the committer leased no slots"
        time.sleep(0.005)


def test_a_leased_put_makes_no_call_and_commits_in_the_background(world):  # noqa: F811
    client = leased_client(world)
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    assert drive(client._put(TOKENS, kv)) == 4 * PAGE_TOKENS  # the first reserves
    assert world.local.calls[-1] == "commit"
    wait_leased(client, 4)
    calls = len(world.local.calls)
    other_tokens = [t + 1000 for t in TOKENS]
    assert drive(client._put(other_tokens, kv)) == 4 * PAGE_TOKENS
    assert client.puts.settle(5.0)  # the committer's call, after the put returned
    made = world.local.calls[calls:]
    assert made and set(made) == {"put_leased"}, made
    other_keys = client.keys(other_tokens)
    assert all(k in world.local.pages for k in other_keys)
    for p, k in enumerate(other_keys):  # each page's bytes sit in the slot it was committed in
        tier, slot = world.local.pages[k]
        stored = world.arenas[tier].view(slot)[: G.page_bytes].view(torch.float32)
        assert torch.equal(stored, kv[:, :, :, p * PAGE_TOKENS:(p + 1) * PAGE_TOKENS]
                           .contiguous().view(-1))
    assert client.counters["leased_pages"] == 4


def test_a_commit_at_a_closed_gate_makes_no_call_and_its_pages_are_a_miss(world):  # noqa: F811
    """ray.shutdown() under way (cluster/ray_gate.py): the committer sends nothing, and the
    writes it holds are answered for, as misses, so nothing waits on them."""
    gate = {"open": True}
    client = leased_client(world, gate=lambda: contextlib.nullcontext(gate["open"]))
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    assert drive(client._put(TOKENS, kv)) == 4 * PAGE_TOKENS  # the first reserves
    wait_leased(client, 4)
    gate["open"], calls = False, len(world.local.calls)
    other_tokens = [t + 1000 for t in TOKENS]
    assert drive(client._put(other_tokens, kv)) == 4 * PAGE_TOKENS  # into leased slots
    assert client.puts.settle(5.0)
    assert world.local.calls[calls:] == []
    assert not any(k in world.local.pages for k in client.keys(other_tokens))
    assert client.counters["leased_pages"] == 0


def test_puts_in_quick_succession_commit_in_one_call_sent_after_they_returned(world):  # noqa: F811
    """The commit waits COMMIT_AFTER_S after a write (its call's Python would otherwise take
    the interpreter lock from the put returning), and writes made meanwhile join it."""
    client = leased_client(world)
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    drive(client._put(TOKENS, kv))
    wait_leased(client, 4)
    half = 2 * PAGE_TOKENS
    puts.COMMIT_AFTER_S = 0.5  # a window wide enough for two puts on any machine
    try:
        calls = len(world.local.calls)
        for offset in (1000, 2000):
            tokens = [t + offset for t in TOKENS[:half]]
            assert drive(client._put(tokens, kv[:, :, :, :half])) == half
        assert world.local.calls[calls:] == []  # nothing sent yet: both wait in the window
        assert client.puts.settle(5.0)  # a read of its own writes sends them at once
        assert world.local.calls[calls:] == ["put_leased"]
    finally:
        puts.COMMIT_AFTER_S = COMMIT_AFTER_S
    assert client.counters["leased_pages"] == 4


def test_a_leased_put_whose_slots_lapsed_writes_nothing_and_reserves(world):  # noqa: F811
    client = leased_client(world)
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    drive(client._put(TOKENS, kv))
    wait_leased(client, 4)
    world.local.fail = {"put_leased"}  # no new lease from here on
    for k in KEYS:  # room for the reservation the next put falls back to
        tier, slot = world.local.pages.pop(k)
        world.arenas[tier].free(slot)
    leased = client.puts.pool.free.copy()
    for tier, slot, _ in leased.tolist():  # the node let the lease go: the fence moves
        world.arenas[tier].generations[slot] += 1
    other_tokens = [t + 1000 for t in TOKENS]
    before = [world.arenas[t].view(s)[: G.page_bytes].clone() for t, s, _ in leased.tolist()]
    calls = len(world.local.calls)
    assert drive(client._put(other_tokens, kv)) == 4 * PAGE_TOKENS  # through a reservation
    assert "commit" in world.local.calls[calls:]
    for (tier, slot, _), old in zip(leased.tolist(), before, strict=True):
        assert torch.equal(world.arenas[tier].view(slot)[: G.page_bytes], old), \
            "a leased put wrote into a slot after its lease lapsed"


# ---- a lease is spare room: revoked under pressure, never paid for with stored pages ------


def stored_ids(store) -> list[int]:
    return sorted(int.from_bytes(k[1:], "little") for k in store.pool(G).index)


def test_a_lease_takes_only_slots_of_chunks_held_and_the_node_readies_more_ahead(stores):
    store = stores.make(device_pages=0, host_pages=64, disk_pages=0)  # a lease: 16 at most
    reply = asyncio.run(store.put_leased(G, LeaseRequest(0, want=2)))
    assert reply.places == [] and host_used(store) == 0  # nothing held: nothing faulted in
    slots = store.pool(G).memory[HOST].slots
    ready(store, 1)  # one chunk held
    held = slots.num_free_held
    assert 1 <= held < 16
    reply = asyncio.run(store.put_leased(G, LeaseRequest(0, want=held + 1)))
    assert len(reply.places) == held and slots.num_free_held == 0
    assert asyncio.run(store.grow_ahead(G)) >= 1  # as many free as the top-up asked, or more
    assert slots.num_free_held >= held + 1
    more = asyncio.run(store.put_leased(G, LeaseRequest(reply.lease_id, want=1)))
    assert len(more.places) == 1


def test_a_lease_in_a_full_tier_gets_nothing_and_demotes_nothing(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=4)
    asyncio.run(store_put(store, list(range(8))))
    reply = lease(store, 2)
    assert reply.places == [] and store.pool(G).evictions == [0, 0, 0]
    assert store.pool(G).tier_counts() == {"device": 0, "host": 8, "disk": 0}


def test_a_put_into_a_tier_full_of_pages_and_an_idle_lease_takes_the_lease_back(stores):
    """6 pages stored, 2 slots leased by an idle client: the tier is full. Another client's
    put of 2 pages takes the leased slots back; no stored page moves, none is dropped."""
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    asyncio.run(store_put(store, list(range(6))))
    reply = lease(store, 2)
    assert len(reply.places) == 2 and host_used(store) == 8
    assert asyncio.run(store_put(store, [10, 11])) == 2
    assert stored_ids(store) == [0, 1, 2, 3, 4, 5, 10, 11]
    assert store.pool(G).evictions == [0, 0, 0]
    for i in (0, 5, 10, 11):
        assert torch.equal(read(store, i), page(i))
    stats = store.stats()
    assert stats["revoked_leased_slots"] == 2 and stats["leased_slots"] == 0
    # the idle client hears of it in its next call: both of its slots, as leased
    told = lease(store, 0, reply.lease_id)
    assert told.lease_id == reply.lease_id and sorted(told.revoked) == sorted(reply.places)


def test_a_revoked_slot_written_late_is_refused_even_when_leased_again(stores):
    """The client wrote page 20 into a leased slot, the node revoked it (a put needed the
    room, then freed it again), and leased it to the same client at a new generation. The
    late commit names the old generation: refused, nothing indexed; the new one commits."""
    store = stores.make(device_pages=0, host_pages=4, disk_pages=0)
    reply = lease(store, 1)
    (old,) = reply.places
    write(store, old, 20)  # written, its commit not sent yet
    asyncio.run(store_put(store, [0, 1, 2, 3]))  # the tier fills: the slot is revoked
    pool = store.pool(G)
    assert store.stats()["revoked_leased_slots"] == 1
    assert pool.memory[HOST].generation(old[1]) > old[2]  # fenced
    (reused,) = [k for k, e in pool.index.items() if e.slot == old[1]]  # one of pages 0..3
    pool.drop(reused)  # its room comes back...
    again = lease(store, 1, reply.lease_id)  # ...and goes to the same lease, anew
    assert again.places == [(HOST, old[1], pool.memory[HOST].generation(old[1]))]
    assert again.revoked == [old]
    late = lease(store, 0, reply.lease_id, [key(20)], [old])
    assert late.committed == [False] and read(store, 20) is None
    write(store, again.places[0], 21)
    done = lease(store, 0, reply.lease_id, [key(21)], [again.places[0]])
    assert done.committed == [True] and torch.equal(read(store, 21), page(21))
    for i in (0, 1, 2, 3):
        if key(i) != reused:
            assert torch.equal(read(store, i), page(i)), "a stored page changed"


def test_a_leased_slot_a_writer_holds_is_not_revoked_and_its_page_commits(stores):
    """A client holds a leased slot's write lock from its copy until its commit is answered.
    A node short of room passes that slot over (it demotes a stored page instead), so a
    page whose put has returned is not lost before its commit lands."""
    store = stores.make(device_pages=0, host_pages=4, disk_pages=0)
    reply = lease(store, 1)
    place = reply.places[0]
    tier, slot, _ = place
    writer = SlotFence(store.pool(G).memory[tier].descriptor().generations_path)
    try:
        assert writer.lock([slot])  # the client's copy, its lock kept until the answer
        write(store, place, 20)
        asyncio.run(store_put(store, [0, 1, 2]))  # 3 free slots: no revocation needed
        assert asyncio.run(store_put(store, [3])) == 1  # the tier is full: a stored page goes
        stats = store.stats()
        assert stats["revoked_leased_slots"] == 0 and stats["written_leased_slots_kept"] == 1
        assert stats["quarantined_slots"] == 0 and store.pool(G).index[key(3)].slot != slot
        assert store.pool(G).evictions[HOST] == 1
        done = lease(store, 0, reply.lease_id, [key(20)], [place])
        assert done.committed == [True] and done.revoked == []
        assert torch.equal(read(store, 20), page(20))
    finally:
        writer.unlock([slot])
        writer.close()


def test_a_revoke_takes_the_unheld_leased_slots_and_passes_over_a_held_one(stores):
    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    reply = lease(store, 2)
    (held_place, free_place) = sorted(reply.places, key=lambda p: -p[1])  # highest first
    writer = SlotFence(store.pool(G).memory[HOST].descriptor().generations_path)
    try:
        assert writer.lock([held_place[1]])
        asyncio.run(store_put(store, list(range(7))))  # 6 free + 1 revoked: the unheld one
        stats = store.stats()
        assert stats["revoked_leased_slots"] == 1 and stats["written_leased_slots_kept"] == 1
        pool = store.pool(G)
        assert pool.memory[HOST].generation(free_place[1]) > free_place[2]  # fenced
        assert pool.memory[HOST].generation(held_place[1]) == held_place[2]  # untouched
        told = lease(store, 0, reply.lease_id)
        assert told.revoked == [free_place]
    finally:
        writer.unlock([held_place[1]])
        writer.close()


def test_leased_slots_count_in_no_namespace_until_committed(stores):
    from policies.quota import Quota

    store = stores.make(device_pages=0, host_pages=8, disk_pages=0)
    store.set_quotas({}, {"x": Quota(max_bytes=2 * store.pool(G).geometry.slot_bytes)})
    ready(store, 2)
    assert asyncio.run(store.put_leased(G, LeaseRequest(0, want=2, namespace="x"))).places
    assert store.elastic.namespace_bytes(HOST) == {}
    asyncio.run(store_put(store, [0]))  # another namespace's page
    ready(store, 4)
    reply = asyncio.run(store.put_leased(G, LeaseRequest(0, want=2, namespace="x")))
    for i, place in zip((30, 31), reply.places, strict=True):
        write(store, place, i)
    done = asyncio.run(store.put_leased(G, LeaseRequest(
        reply.lease_id, (key(30), key(31)), tuple(reply.places), namespace="x")))
    assert done.committed == [True, True]
    assert store.elastic.namespace_bytes(HOST)["x"] == 2 * G.slot_bytes
