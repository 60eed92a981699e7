"""A pool's gets: pin the longest local prefix in a mapped tier, reading disk pages up
first (a mixin of Pool: cluster/core/pool.py).

    acquire(keys) --> pins +1 --> disk pages read up into host, host pages lifted to device
                  --> (tier, slot, generation) of each page of the prefix, in memory
    release(keys) --> pins -1      (a pinned page is never chosen as a victim nor moved)
"""

from __future__ import annotations

import time

from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.keys import PageKey
from cluster.core.pool_entry import State

MAX_LOAD_ROUNDS = 3


class PinnedGets:
    """Pool's reads. Uses the pool's index, tiers, policies, load_from_disk and
    promote_many."""


    def local_prefix(self, keys: list[PageKey]) -> int:
        """How many leading keys this pool holds (ready, any tier)."""
        for position, key in enumerate(keys):
            entry = self.index.get(key)
            if entry is None or entry.state == State.PENDING:
                return position
        return len(keys)

    async def acquire(self, keys: list[PageKey]) -> list[tuple[int, int, int]]:
        """Pin the longest local prefix of keys in a mapped tier; (tier, slot, generation) each.

        No more pages are pinned than the mapped tiers hold. Disk pages are read up into host
        first; a page that finds no room there is retried once after letting go of our pins
        on the rest of the prefix (they may hold that room). A page lost ends the prefix.
        """
        self.last_access_s = time.monotonic()
        count = min(self.local_prefix(keys), self._num_slots(DEVICE) + self._num_slots(HOST))
        entries = [self.index[key] for key in keys[:count]]
        for entry in entries:
            entry.pins += 1
        top_tier = self.top_tier
        if any(entry.tier != top_tier for entry in entries):  # pages to read or lift up
            for _ in range(MAX_LOAD_ROUNDS):  # reading up frees disk; lifting up frees host
                await self.load_from_disk(keys[:count])
                await self.promote_many(keys[:count], own_pins=1)
                if not any(self._on_disk_ready(k) for k in keys[:count]):
                    break
        located: list[tuple[int, int, int]] = []
        for position, key in enumerate(keys[:count]):
            place = self._pinned_place(key)
            if place is None:
                self.release(keys[position + 1 : count])
                if position + 1 < count:  # our own pins may have held the room it needs
                    await self.load_from_disk([key])
                    place = self._pinned_place(key)
                if place is None:
                    self.release([key])
                else:
                    located.append(place)
                break
            located.append(place)
        return located

    def _pinned_place(self, key: PageKey) -> tuple[int, int, int] | None:
        """A pinned page's (tier, slot, generation) if it is in memory, else None."""
        entry = self.index.get(key)
        if entry is None or entry.tier == DISK:
            return None
        self.policies[entry.tier].on_access(key)
        return entry.tier, entry.slot, self.memory[entry.tier].generation(entry.slot)

    def touch(self, keys: list[PageKey]) -> list[int]:
        """Note an access to each ready page among `keys` (a disk page's too: a client read
        it from the slab files); returns the tier of each one found."""
        self.last_access_s = time.monotonic()
        tiers: list[int] = []
        for key in keys:
            entry = self.index.get(key)
            if entry is not None and entry.state == State.READY:
                self.policies[entry.tier].on_access(key)
                tiers.append(entry.tier)
        return tiers

    def release(self, keys: list[PageKey]) -> None:
        for key in keys:
            entry = self.index.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
