"""Demotion ahead of need: room kept free in the host tier between requests (a mixin of Pool).

    a batch lands in a full host     its room is made first: the coldest host pages are
    (a read-up from disk, a put)     written to disk (O_DIRECT, fdatasync), and it waits

A read-up from disk into a full host tier paid for two disk operations on its own path: the
read and the victims' writes (cluster/core/disk_loads.py overlaps them, but on one disk and
two cores they still add up: ~15 ms against ~4 ms from host for 30 pages of 128 KiB). Linux's
page reclaim answers the same problem with watermarks kept by kswapd; here the watermark is
learned, not set by hand. Each batch bound for the host tier that would not fit in its free
room beyond what is kept (one that leans on the headroom), and each lease top-up for puts
that found too few free slots (put_leases.py), is remembered for WINDOW_S; the
node's loop (actors/node_cache.py) then demotes, between requests, the coldest pages until
the largest such recent batch fits in free slots, at most MAX_FRACTION of the tier. Slots
leased to clients' puts and not yet written count as room: a batch takes them back before it
demotes anything (put_leases.py), so the lease and the headroom share one reserve of room. A tier
that never sees such batches (one that is not full, or has no disk below it) keeps nothing
free, so the capacity this costs is only what the workload's own batches need.

Room kept ahead is never worth a page: a victim the disk does not take (a full or failing
disk) stays in host, and no pass runs until DISK_RETRY_S after the failed write
(pool_moves.py). Before, each pass dropped the coldest pages (a put's newest, under the
putdepth policy) for room no batch had asked for yet, and the next pass, a loop tick later,
dropped more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.core.elastic import guarded_victims
from cluster.core.geometry import HOST

WINDOW_S = 60.0  # how long a batch's size is kept in mind after the last one like it
MAX_FRACTION = 0.25  # of the host tier's slots, the most that is kept free


@dataclass(slots=True)
class RecentPeak:
    """The largest batch (pages) seen within `window_s` of the last batch at least half its
    size: a peak is forgotten once the batches that made it stop coming."""

    window_s: float = WINDOW_S
    pages: int = 0
    seen_s: float = float("-inf")

    def note(self, pages: int, now_s: float) -> None:
        if pages >= self.pages or now_s - self.seen_s > self.window_s:
            self.pages, self.seen_s = pages, now_s
        elif 2 * pages >= self.pages:
            self.seen_s = now_s

    def value(self, now_s: float) -> int:
        return self.pages if now_s - self.seen_s <= self.window_s else 0


class DemoteAhead:
    """Pool's host headroom. Uses the pool's tiers, policies, room lock, demote and
    disk_failing (pool_moves.py)."""

    host_peak: RecentPeak
    demoted_ahead: int

    def headroom_pages(self, now_s: float | None = None) -> int:
        """Host slots kept free now: the recent peak batch, capped; 0 without a disk tier."""
        if self.disk is None:
            return 0
        now_s = time.monotonic() if now_s is None else now_s
        cap = int(self._num_slots(HOST) * MAX_FRACTION)
        return min(cap, self.host_peak.value(now_s))

    def room_without_writes(self) -> int:
        """Host slots a batch can take with no page demoted: the free ones and those leased
        to clients' puts and not yet written (taken back first: put_leases.py)."""
        return self._free_slots(HOST) + self.num_leased(HOST)

    def headroom_short(self) -> int:
        """Pages still to demote before the headroom is free (0 when it is)."""
        target = self.headroom_pages()
        if target <= self._free_slots(HOST):  # the leases need not be counted
            return 0
        return max(0, target - self.room_without_writes())

    def note_host_batch(self, num_pages: int) -> None:
        """A batch of `num_pages` is about to land in host: remembered when it leans on the
        headroom (it would not fit in the room without writes beyond what is kept). On every
        reserve's path: the leased slots are counted only when the free ones fall short."""
        spare = self._free_slots(HOST) - self.headroom_pages()
        if num_pages > spare and num_pages > spare + self.num_leased(HOST):
            self.host_peak.note(num_pages, time.monotonic())

    def note_short_lease(self, num_pages: int) -> None:
        """A lease top-up for puts asked `num_pages` host slots and found too few free: a
        batch that found the tier full, remembered as one (put_leases.lease_free)."""
        self.host_peak.note(num_pages, time.monotonic())

    async def demote_ahead(self) -> int:
        """Demote the host tier's coldest unpinned pages to disk until the headroom is free
        (the node's loop, between requests); returns how many were demoted. Pages the disk
        does not take stay in host, and no pass runs while the disk fails its writes."""
        if self.disk_failing() or not self.headroom_short():
            return 0
        async with self.room_lock:  # a put's own room is not split with this pass
            shortfall = self.headroom_short()
            victims = guarded_victims(self, HOST, shortfall, "") if shortfall > 0 else []
            kept = []
            if victims:
                # Counted with the evictions (demote counts those on entry, before its first
                # await), so that no stats read while the writes run sees one without the other.
                self.demoted_ahead += len(victims)
                kept = await self.demote(victims, HOST, keep_unmoved=True)
                self.demoted_ahead -= len(kept)
        return len(victims) - len(kept)
