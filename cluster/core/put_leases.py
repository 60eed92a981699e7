"""Free slots leased to a client ahead of its puts, and the commit that names their pages.

A put through a reservation makes two calls on its path (reserve, then commit). A leased put
makes none: the client holds a lease on free slots, copies pages straight into them, and
tells the node which key each slot now holds later, batched, in the same call that tops the
lease up (cluster/puts.py):

    node                                   client
    lease: free slots, not in the index    take(n) slots of its lease
                                           lock, generations unmoved?, copy     (fence)
    commit(keys, slots) <------------------ a background call: these keys are in those slots
      slot still in this lease?            (and: lease me `want` more, for the next puts)
        key new: index it READY (visible)
        key already held: free the slot
      lease `want` more free slots -------> unlock the written slots; the next puts' slots

Nothing half-stored is visible: a leased slot is in no index until its commit arrives, after
the copy. A lease lapses `reserve_lease_s` after its last call, as a reservation does: its
slots that no writer holds are fenced (the generation moves: a writer that has not locked yet
writes nothing) and freed. A slot whose lock a writer holds is kept in the lease until the
lock goes: the client keeps a written slot's lock until its commit is answered, so a client
that stalls past its lease still gets its commit (its put has returned). A client that dies
with leased, uncommitted slots loses them to the node (the kernel drops its locks).

A lease is spare room, never used room:
- a lease takes only slots that are free (or that the node's budget grants); it never
  demotes a stored page, nor evicts one under a namespace's max, to get them, and takes
  none while anyone makes room under the pool's room lock (the slots freed are theirs).
  A top-up that finds the host tier full is remembered as a batch that found it full: the
  node's loop then keeps that much room free between requests by demoting the coldest
  pages to disk (demote_ahead.py), as it does for puts and read-ups, and the client's next
  top-up (its short retry) takes it. So a steady stream of puts into a full host tier stays leased;
- a node that needs room (a put, a promotion, a demotion into the tier, another model's
  claim on a chunk) revokes leased slots before it demotes anything (Pool.make_room,
  elastic.release_chunks): highest slot first, since a client writes its lowest first.
  Only a slot no writer holds is revoked: a client keeps a slot's write lock from its copy
  until its commit is answered, so a written page whose put has returned is never taken
  back before it is indexed. A revoked slot is fenced and freed; the next reply names it,
  so the client drops it; a copy that reaches it after is refused by its fence, and the
  put reserves instead;
- a commit names each slot with the generation it was leased at, so a write into a slot
  revoked and then leased again (a new generation) is refused, never indexed;
- leased slots count in no namespace's pages until committed; the commit then makes room
  under the namespace's max as a reserve does (its own pages first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.core.geometry import HOST, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.namespace_max import namespace_room_pages, within_namespace_max
from cluster.core.pool_entry import Entry, State

MAX_LEASED_FRACTION = 0.25  # of the top tier's slots, held by one lease at most


@dataclass(slots=True)
class SlotLease:
    """A client's lease on free slots of one pool: (tier, slot) leased, not yet committed."""

    geometry: PageGeometry
    namespace: str
    slots: dict[tuple[int, int], int]  # (tier, slot) -> its generation when leased
    deadline_s: float
    revoked: list[tuple[int, int, int]] = field(default_factory=list)  # not yet told


class LeasedSlots:
    """Pool methods for leased puts (a mixin of Pool: cluster/core/pool.py)."""

    # PutLeases.revoke and PutLeases.count, set by the node (NodeStore) on each of its pools
    lease_revoker: Callable[[LeasedSlots, int, int], int] | None = None
    lease_counter: Callable[[LeasedSlots, int], int] | None = None

    def lease_free(self, tier: int | None, count: int,
                         namespace: str = "") -> list[tuple[int, int]]:
        """Up to `count` free slots of `tier` (None: the top tier), taken out of the free list
        but indexed under no key: (tier, slot) each. Only free slots of chunks already held
        are leased: no page is demoted, and no chunk faulted in, for a lease. None while
        someone makes room under the room lock: the slots its victims free are its own (a
        top-up that took them left a read-up or a put part of its room)."""
        self.last_access_s = time.monotonic()
        if self.room_lock.locked():
            # Not noted as a short lease: the tier was not found full, only busy; the
            # client's short retry asks again and is noted then if it finds it full.
            return []
        level = self.top_tier if tier is None else tier
        room = namespace_room_pages(self, level, namespace)
        if room is not None:
            count = min(count, room)
        leased: list[tuple[int, int]] = []
        for _ in range(max(0, count)):
            slot = self.memory[level].slots.alloc_held()
            if slot is None:  # no chunk is grown (faulted in) on the call's path for a
                break         # lease: the node readies chunks ahead (NodeStore.grow_ahead)
            leased.append((level, slot))
        if level == HOST and len(leased) < count:
            # No page is demoted for a lease here; the node's loop keeps the room instead,
            # and the client's retry finds it. Without this every put into a full host tier
            # reserved and made its room on its own path.
            self.note_short_lease(count)
        return leased

    def revoke_leased(self, tier: int, count: int) -> int:
        """Take up to `count` unused leased slots of `tier` back (fenced, freed): room that
        is made before any page is demoted. Set by the node's PutLeases (none on a pool of
        its own); returns how many."""
        return 0 if self.lease_revoker is None else self.lease_revoker(self, tier, count)

    def num_leased(self, tier: int) -> int:
        """Slots of `tier` leased to clients and not yet committed: room revoke_leased can
        make without moving a page (a slot being written is kept, so this is an upper bound)."""
        return 0 if self.lease_counter is None else self.lease_counter(self, tier)

    def commit_leased(self, keys: list[PageKey], slots: list[tuple[int, int]],
                      namespace: str = "") -> list[bool]:
        """Index each key READY in its leased, written slot; a key already here (stored, or
        another put's reservation) keeps its page, and the slot goes back. Whether each
        key was committed."""
        committed: list[bool] = []
        parent = None  # the put's previous new page: putdepth ranks by depth in the put
        with self.held_batched():
            for key, (tier, slot) in zip(keys, slots, strict=True):
                if key in self.index:
                    self._release_written(tier, slot)
                    committed.append(False)
                    continue
                entry = self.index[key] = Entry(tier, slot, State.READY, namespace=namespace)
                self._count(entry, 1)
                self.policies[tier].on_insert(key, parent)
                parent = key
                self._on_event(key, tier)
                committed.append(True)
        return committed

    def num_slots_top(self) -> int:
        return self._num_slots(self.top_tier)

    def take_back_unheld(self, tier: int, slot: int) -> bool:
        """Fence and free a leased slot that no writer holds (True). A slot whose write lock
        a client holds is in use: its copy is in flight, or it is written and the client
        keeps the lock until its commit is answered (cluster/puts.py). It stays leased
        (False): taking it would lose a page whose put already returned."""
        fence = self.fences[tier]
        if not fence.lock([slot]):
            return False
        try:
            self.memory[tier].generations[slot] += 1  # a writer that locks later writes nothing
            self.memory[tier].free(slot)
        finally:
            fence.unlock([slot])
        return True

    def release_leased(self, slots: list[tuple[int, int]]) -> None:
        """Give leased slots back (the lease ended): fenced, and quarantined while a late
        writer still holds one."""
        for tier, slot in slots:
            self._release_written(tier, slot)


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """A leased-put call: the pages written into lease `lease_id`'s slots (key i in
    slots[i], as (tier, slot, generation) as leased) to commit, and how many more free slots
    to lease."""

    lease_id: int
    keys: tuple[PageKey, ...] = ()
    slots: tuple[tuple[int, int, int], ...] = ()
    want: int = 0
    namespace: str = ""
    tier: int | None = None  # where to lease (None: the top tier)


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """What a leased-put call answers: which keys were committed, and the lease as it now is
    (its id, the slots newly leased as (tier, slot, generation), and its life in seconds
    from the call). A lease_id that differs from the one sent means the old lease lapsed:
    its slots are not the client's any more. `revoked`: slots of the lease the node took
    back since its last answer, as (tier, slot, generation) as leased."""

    committed: list[bool]
    lease_id: int
    places: list[tuple[int, int, int]]
    lease_s: float
    revoked: list[tuple[int, int, int]] = field(default_factory=list)
    node_s: tuple[float, float] = (0.0, 0.0)  # the node's commit, and its top-up, in s


class PutLeases:
    """The node's slot leases (NodeStore.put_leases), each with a deadline."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.leases: dict[int, SlotLease] = {}
        self.counters = {"leased_puts": 0, "leased_pages": 0, "leased_duplicates": 0,
                         "lapsed_commits": 0, "expired_slot_leases": 0,
                         "revoked_leased_slots": 0, "leased_over_namespace_max": 0,
                         "written_leased_slots_kept": 0}
        self.last_want: dict[tuple, int] = {}  # (geometry, tier) -> the latest top-up's ask

    def attach(self, pool: LeasedSlots) -> None:
        """Let `pool` take its unused leased slots back when it needs room."""
        pool.lease_revoker = self.revoke
        pool.lease_counter = self.count

    async def commit(self, pool, lease_id: int, keys: list[PageKey],
                     slots: list[tuple[int, int, int]]) -> list[bool]:
        """Commit the written slots of lease `lease_id`; a slot not (or no longer) in it, or
        leased at another generation (revoked, then leased again), is refused, and so is its
        key."""
        lease = self.leases.get(lease_id)
        if not keys:
            return []
        if lease is None or lease.geometry != pool.geometry:
            self.counters["lapsed_commits"] += len(keys)
            return [False] * len(keys)
        ours: list[tuple[PageKey, tuple[int, int]]] = []
        for key, (tier, slot, generation) in zip(keys, slots, strict=True):
            if lease.slots.get((tier, slot)) == generation:
                del lease.slots[(tier, slot)]
                ours.append((key, (tier, slot)))
        ours = await self._within_namespace_max(pool, lease.namespace, ours)
        done = dict(zip([key for key, _ in ours],
                        pool.commit_leased([k for k, _ in ours], [s for _, s in ours],
                                           lease.namespace), strict=True))
        committed = [done.get(key, False) for key in keys]
        self.counters["leased_puts"] += 1
        self.counters["leased_pages"] += sum(committed)
        self.counters["leased_duplicates"] += len(ours) - sum(committed)
        self.counters["lapsed_commits"] += len(keys) - len(ours)
        return committed

    async def _within_namespace_max(self, pool, namespace: str,
                                    ours: list[tuple[PageKey, tuple[int, int]]]) -> list:
        """The writes that fit under the namespace's max once committed (its own pages
        demoted first, as for a reserve); the slots of the rest go back."""
        if pool.elastic.room is None or not ours:
            return ours
        kept = []
        async with pool.room_lock:
            for tier in sorted({slot[0] for _, slot in ours}):
                mine = [(k, s) for k, s in ours if s[0] == tier]
                fresh = [(k, s) for k, s in mine if k not in pool.index]
                allowed = await within_namespace_max(pool, tier, namespace, len(fresh))
                over = {k for k, _ in fresh[allowed:]}
                for key, slot in mine:
                    if key in over:
                        pool.release_leased([slot])
                    else:
                        kept.append((key, slot))
                self.counters["leased_over_namespace_max"] += len(over)
        return kept

    def count(self, pool, tier: int) -> int:
        """Slots of `pool`'s `tier` held by leases now."""
        return sum(1 for lease in self.leases.values() if lease.geometry == pool.geometry
                   for (t, _) in lease.slots if t == tier)

    def revoke(self, pool, tier: int, count: int) -> int:
        """Take up to `count` unused leased slots of `pool`'s `tier` back: fenced and freed,
        highest slot first. A slot a writer holds (copying, or written and waiting for its
        commit) is passed over. The lease hears of them in its next reply. Returns how many."""
        held = [(slot, lease_id) for lease_id, lease in self.leases.items()
                if lease.geometry == pool.geometry
                for (t, slot) in lease.slots if t == tier]
        held.sort(reverse=True)
        revoked = 0
        for slot, lease_id in held:
            if revoked >= count:
                break
            if not pool.take_back_unheld(tier, slot):
                self.counters["written_leased_slots_kept"] += 1
                continue
            lease = self.leases[lease_id]
            generation = lease.slots.pop((tier, slot))
            lease.revoked.append((tier, slot, generation))
            revoked += 1
        self.counters["revoked_leased_slots"] += revoked
        return revoked

    async def call(self, pool, request: LeaseRequest, new_id: int) -> LeaseReply:
        """Commit what `request` wrote, then top its lease up to `request.want` more free
        slots and renew it: one call for both (a fresh lease, `new_id`, when the request's
        is not live: the client then drops the slots it held)."""
        start_s = time.perf_counter()
        committed = await self.commit(pool, request.lease_id, list(request.keys),
                                      [tuple(slot) for slot in request.slots])
        committed_s = time.perf_counter()
        lease_id, places = self._top_up(pool, request, new_id)
        lease = self.leases.get(lease_id)
        revoked = []
        if lease is not None:
            revoked, lease.revoked = lease.revoked, []
        node_s = (committed_s - start_s, time.perf_counter() - committed_s)
        return LeaseReply(committed, lease_id, places, self.lease_s, revoked, node_s)

    def _top_up(self, pool, request: LeaseRequest,
                new_id: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Lease up to `request.want` more free slots, as (tier, slot, generation) (no
        await: no page is demoted for a lease, and the slots and the lease change
        together)."""
        lease = self.leases.get(request.lease_id)
        lease_id = request.lease_id
        if lease is None or lease.geometry != pool.geometry:
            lease, lease_id = None, new_id
        held = len(lease.slots) if lease is not None else 0
        cap = max(1, int(MAX_LEASED_FRACTION * pool.num_slots_top()))
        want = min(request.want, cap - held)
        level = pool.top_tier if request.tier is None else request.tier
        if want > 0:
            self.last_want[(pool.geometry, level)] = want
        slots = pool.lease_free(request.tier, want, request.namespace) if want > 0 else []
        if lease is None:
            if not slots:
                return lease_id, []
            lease = self.leases[lease_id] = SlotLease(pool.geometry, request.namespace,
                                                      {}, 0.0)
        places = pool.places(slots)
        lease.slots.update(((tier, slot), generation) for tier, slot, generation in places)
        lease.deadline_s = time.monotonic() + self.lease_s
        return lease_id, places

    def end(self, pools: dict, lease_id: int) -> int:
        """End a lease now: its uncommitted slots go back. Returns how many."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return 0
        pools[lease.geometry].release_leased(sorted(lease.slots))
        return len(lease.slots)

    def expire(self, pools: dict, now_s: float) -> int:
        """End the leases past their deadline (a dead or stalled client's); how many.

        A slot whose write lock a writer still holds is kept, and its lease with it: a live
        client holds a slot's lock from its copy until its commit is answered, so that page's
        put has returned and its commit is on the way (a stalled call, a client paused).
        A dead client's locks went with it, so its slots are freed at the next expiry. The
        slots freed from a kept lease are told in its next reply, as revoked ones are."""
        lapsed = [i for i, lease in self.leases.items() if lease.deadline_s < now_s]
        ended = 0
        for lease_id in lapsed:
            lease = self.leases[lease_id]
            pool = pools[lease.geometry]
            freed = [place for place in sorted(lease.slots) if pool.take_back_unheld(*place)]
            for place in freed:
                lease.revoked.append((*place, lease.slots.pop(place)))
            if lease.slots:
                lease.deadline_s = now_s + self.lease_s
                self.counters["written_leased_slots_kept"] += len(lease.slots)
            else:
                del self.leases[lease_id]
                ended += 1
        self.counters["expired_slot_leases"] += ended
        return ended

    def num_leased(self) -> int:
        return sum(len(lease.slots) for lease in self.leases.values())

    def wanted(self, geometry, tier: int) -> int:
        """How many slots of `geometry`'s `tier` the latest top-up there asked for: as many
        are readied ahead for the next one (NodeStore.grow_ahead)."""
        return self.last_want.get((geometry, tier), 0)
