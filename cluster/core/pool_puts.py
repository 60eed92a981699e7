"""A pool's puts through a reservation: reserve, write, commit or abort (a mixin of Pool:
cluster/core/pool.py).

    reserve(keys, owner) --> PENDING slots --(a client, a pull, write_page copies in)-->
        commit(keys, owner) --> READY: in the eviction policy, published, reported
        abort(keys, owner) or the reservation expires --> fenced, freed or quarantined

A reserved memory slot is written by someone else (a client, a pull's thread), so it goes back
only through its write fence (tiers/fence.py): a slot whose writer may still be copying in
when its reservation ends is quarantined, and freed once that writer is done or dead.
"""

from __future__ import annotations

import time

import numpy as np

from cluster.core.geometry import HOST
from cluster.core.keys import PageKey
from cluster.core.namespace_max import within_namespace_max
from cluster.core.pool_entry import Entry, State
from cluster.core.tiers.memory import readonly_tensor


class ReservedPuts:
    """Pool's reservations. Uses the pool's index, tiers, fences, policies, room_lock,
    make_room, _count and _on_event."""


    async def reserve(self, keys: list[PageKey], owner: int, tier: int | None = None,
                      namespace: str = "") -> list[tuple[int, int] | None]:
        """Slots for the keys not yet stored, as (tier, slot); None where the page is stored.

        Pages fill the top tier (or `tier`) first and spill into the memory tiers below it.
        The result covers the longest prefix of `keys` that is stored or now reserved for
        `owner`: an expected shortage shortens it, to [] when nothing fits, and so does a page
        that another put holds reserved (it is not stored until that put commits).
        """
        self.last_access_s = time.monotonic()
        placed: dict[PageKey, tuple[int, int]] = {}
        async with self.room_lock:  # the room one put makes is its own (put_leases.py too)
            for level in range(self.top_tier if tier is None else tier, HOST + 1):
                count = min(len(self._fresh(keys)), self._num_slots(level))
                if count == 0:
                    continue
                count = await within_namespace_max(self, level, namespace, count)
                await self.make_room(level, count, namespace)
                # Recomputed after the await: a concurrent put may have reserved some.
                for key in self._fresh(keys)[: min(count, self._free_slots(level))]:
                    slot = self.memory[level].alloc()
                    if slot is None:  # the budget went to another pool meanwhile
                        break
                    entry = self.index[key] = Entry(level, slot, State.PENDING, owner=owner,
                                                    namespace=namespace)
                    self._count(entry, 1)
                    placed[key] = (level, slot)
        return self._reserved_prefix(keys, placed, owner)

    def _reserved_prefix(self, keys: list[PageKey], placed: dict[PageKey, tuple[int, int]],
                         owner: int) -> list[tuple[int, int] | None]:
        result: list[tuple[int, int] | None] = []
        for key in keys:
            entry = self.index.get(key)
            if key in placed:
                result.append(placed[key])
            elif entry is not None and entry.state != State.PENDING:
                result.append(None)
            else:
                break
        covered = set(keys[: len(result)])
        self.abort([key for key in placed if key not in covered], owner)
        return result

    def _fresh(self, keys: list[PageKey]) -> list[PageKey]:
        return [k for k in dict.fromkeys(keys) if k not in self.index]

    def _owned(self, key: PageKey, owner: int) -> Entry | None:
        entry = self.index.get(key)
        if entry is None or entry.state != State.PENDING or entry.owner != owner:
            return None
        return entry

    def commit(self, keys: list[PageKey], owner: int) -> int:
        """Make `owner`'s reserved pages visible; returns how many were committed.

        A page whose reservation expired (and was perhaps reserved again by another put) is
        not `owner`'s any more and is skipped.
        """
        committed = 0
        parent = None  # the put's previous new page: putdepth ranks by depth in the put
        with self.held_batched():
            for key in keys:
                entry = self._owned(key, owner)
                if entry is None:
                    continue
                entry.state = State.READY
                self.policies[entry.tier].on_insert(key, parent)
                parent = key
                self._on_event(key, entry.tier)
                committed += 1
        return committed

    def abort(self, keys: list[PageKey], owner: int) -> None:
        """Drop `owner`'s reserved-but-uncommitted pages (a failed, abandoned or expired put).

        Their writer may still be copying in (a stalled client, a pull's thread): each slot
        is fenced (its generation moves, so a writer that has not locked it writes nothing)
        and freed only when no writer holds its lock; else it is quarantined until then.
        """
        for key in keys:
            entry = self._owned(key, owner)
            if entry is not None:
                self._count(entry, -1)
                del self.index[key]
                self._release_written(entry.tier, entry.slot)

    def _release_written(self, tier: int, slot: int) -> None:
        arena = self.memory[tier]
        arena.generations[slot] += 1  # the fence, before looking for a writer
        if self.fences[tier].try_claim(slot):
            arena.free(slot)
        else:
            self.quarantined.append((tier, slot))

    def release_quarantined(self) -> int:
        """Free the quarantined slots whose late writers are done (or dead); returns how many."""
        held = []
        for tier, slot in self.quarantined:
            if self.fences[tier].try_claim(slot):
                self.memory[tier].free(slot)
            else:
                held.append((tier, slot))
        freed = len(self.quarantined) - len(held)
        self.quarantined = held
        return freed

    def places(self, slots: list[tuple[int, int] | None]) -> list[tuple[int, int, int] | None]:
        """Reserved (tier, slot)s with their generation now, (tier, slot, generation): what a
        writer checks under its fence before it copies in (None stays None)."""
        return [None if s is None else (*s, self.memory[s[0]].generation(s[1])) for s in slots]

    def write_page(self, key: PageKey, page: np.ndarray) -> None:
        """Copy bytes of a reserved page in (puts that arrive through Ray, not shm).

        `page` may be raw uint8 or typed; its bytes must fill exactly one page.
        """
        entry = self.index[key]
        assert entry.state == State.PENDING, "write_page needs a reserved page"
        raw = np.ascontiguousarray(page).reshape(-1).view(np.uint8)
        if raw.size != self.geometry.page_bytes:
            raise ValueError(f"a page of {self.geometry.name} is {self.geometry.page_bytes} "
                             f"bytes, got {raw.size}")
        self.view(entry)[: raw.size].copy_(readonly_tensor(raw))
