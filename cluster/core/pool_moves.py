"""A pool's pages moving between tiers: room made by demoting victims, promotion on access
(a mixin of Pool: cluster/core/pool.py).

    device (VRAM)  --demote-->  host (/dev/shm)  --demote-->  disk (O_DIRECT)  --> dropped
          ^------------promote on access--------------------------'

Copies between the memory tiers run in a copy thread (on a CUDA stream where the device tier
is VRAM: tiers/device_copy.py) and disk I/O in the disk arena's threads; both are awaited, off
the owner's event loop. A page that is pinned or moving between tiers is never chosen as a
victim, and a page a reader pinned while it was copied stays where it is.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from cluster.core import quant
from cluster.core.elastic import guarded_victims
from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.keys import PageKey
from cluster.core.namespace_max import admitted_into
from cluster.core.pool_entry import Entry, State
from cluster.core.tiers.device_copy import tier_copies

# After a disk write failed (a full or failing disk), for this long: no disk page is evicted to
# make room for writes that would likely fail too, and no demotion runs ahead of need. Writes
# into free disk slots are still tried; one that lands ends the wait.
DISK_RETRY_S = 5.0


class TierMoves:
    """Pool's demotions, promotions and drops. Uses the pool's index, tiers, policies, codec,
    elastic, evictions, _count and _on_event, and its leases, demotion ahead and checksums
    (put_leases.py, demote_ahead.py, checksums_ahead.py)."""


    async def make_room(self, tier: int, num_pages: int, namespace: str = "",
                        keep_unmoved: bool = False) -> bool:
        """Free up to `num_pages` slots in `tier`: first by revoking unused leased slots
        (put_leases.py), then by taking chunks the node's budget can give (from other pools,
        per the quotas), then by demoting this pool's own unpinned victims, as the namespace
        quotas allow; the memory of new chunks is faulted in off the event loop (ready_held).
        True when all of it is free. `keep_unmoved`: see demote."""
        room = await self._free_room(tier, num_pages, namespace, keep_unmoved)
        if tier != DISK:
            await self.ready_held(tier, num_pages)
        return room

    async def ready_held(self, tier: int, num_pages: int) -> None:
        """Fault in, in a thread, the chunks that the next `num_pages` allocations in memory
        tier `tier` would otherwise fault in on the event loop (ChunkedSlots.alloc grows in
        place): the caller waits either way, but the node's other requests go on meanwhile.
        A fault-in on this VM took 200 ms for 64 MiB of memory the host had not backed."""
        arena = self.memory[tier]
        while arena.slots.num_free_held < min(num_pages, arena.slots.num_free):
            chunk = arena.slots.take_now()
            if chunk is None:
                return
            started_s = time.perf_counter()
            if not await arena.ready_taken(chunk):  # none to give: the put finds no room here
                return
            arena.note_ready_on_path(time.perf_counter() - started_s)

    async def _free_room(self, tier: int, num_pages: int, namespace: str,
                         keep_unmoved: bool) -> bool:
        if tier == DISK:  # slots freed since the last flush come back once their headers are zeroed
            await self.flush_disk_frees()
            if self.disk_failing():  # no page evicted for writes that would likely fail too
                return self._free_slots(DISK) >= num_pages
        elif tier == HOST:
            self.note_host_batch(num_pages)
        shortfall = num_pages - self._free_slots(tier)
        if shortfall > 0 and tier != DISK:  # leased, unwritten slots: room that moves nothing
            self.revoke_leased(tier, shortfall)
            shortfall = num_pages - self._free_slots(tier)
        if shortfall > 0 and self.elastic.reclaim is not None:
            await self.elastic.reclaim(self, tier, shortfall)
            shortfall = num_pages - self._free_slots(tier)
        if shortfall <= 0:
            return True
        victims = guarded_victims(self, tier, shortfall, namespace)
        if victims:
            await self.demote(victims, tier, keep_unmoved)
        return self._free_slots(tier) >= num_pages

    async def demote(self, keys: list[PageKey], tier: int,
                     keep_unmoved: bool = False) -> list[PageKey]:
        """Move pages down: into the next tier with room (skipping a full or absent one),
        dropping only what no lower tier can take; returns the keys not moved.

        `keep_unmoved`: what no lower tier takes (a failing disk, say) stays where it is
        instead. Dropping a page is worth it only to store a new one, which exists nowhere
        else (a put); room for a page that is safe where it is (a read-up from disk, a
        promotion, room kept ahead of need) is not worth a page lost."""
        self.evictions[tier] += len(keys)
        for key in keys:
            self.index[key].state = State.MOVING
        pins = {key: self.index[key].pins for key in keys}  # before any await: _move_memory
        remaining = list(keys)
        try:
            for below in range(tier + 1, DISK + 1):
                if remaining and self._num_slots(below):
                    remaining = await self._move_down(remaining, below, pins, keep_unmoved)
        finally:
            for key in keys:
                if key in self.index:
                    self.index[key].state = State.READY
        if keep_unmoved:
            self.evictions[tier] -= len(remaining)
            return remaining
        with self.held_batched():
            for key in remaining:  # a page a reader pinned while moving stays where it is
                if key in self.index and self.index[key].pins == 0:
                    self.drop(key)
        if tier == DISK:  # so that the room (or a chunk) they held is free at once
            await self.flush_disk_frees()
        return remaining

    def disk_failing(self) -> bool:
        """Whether a disk write failed within DISK_RETRY_S (none has landed since)."""
        return time.monotonic() < self.disk_retry_s

    async def flush_disk_frees(self) -> int:
        """Zero the headers of the disk slots freed since the last flush (in a thread), so
        their pages do not come back after a restart, and hand the slots out again."""
        if self.disk is None or not self.disk.num_freed:
            return 0
        return await asyncio.to_thread(self.disk.flush_freed)

    async def _move_down(self, keys: list[PageKey], below: int, pins: dict[PageKey, int],
                         keep_unmoved: bool) -> list[PageKey]:
        """Move what fits into `below`, each namespace within its max there; returns the
        keys left over (for the tier below that, or to drop)."""
        # The bottom tier makes room as always (its coldest pages give way to warmer ones):
        # keep_unmoved is about writes that fail, not about a disk at capacity (and while its
        # writes fail, the disk evicts nothing: _free_room).
        keep_unmoved = keep_unmoved and below != DISK
        keys, refused = await admitted_into(self, below, keys, keep_unmoved)
        if not keys:
            return refused
        await self.make_room(below, min(len(keys), self._num_slots(below)),
                             keep_unmoved=keep_unmoved)
        room = self._free_slots(below)
        batch, rest = keys[:room], keys[room:] + refused
        if below == DISK:
            moved = set(await self._write_disk(batch))
        else:
            moved = set(await self._move_memory(batch, below, pins))
        return [key for key in batch if key not in moved] + rest

    async def _move_memory(self, keys: list[PageKey], tier: int,
                           pins: dict[PageKey, int]) -> list[PageKey]:
        """Copy pages into `tier` in one batch, off the event loop, then move those that no
        reader pinned since the move was decided (`pins`: each page's pins then, before the
        caller's first await; moving one pinned since would free its slot under the reader);
        returns the keys moved."""
        moves = []
        for key in keys:
            slot = self.memory[tier].alloc()
            if slot is None:
                break
            entry = self.index[key]
            moves.append((key, entry, slot, min(entry.pins, pins[key])))
        pairs = [(self.memory[tier].view(slot), self.view(entry)) for _, entry, slot, _ in moves]
        try:
            await tier_copies().copy(pairs)
        except BaseException:
            for _, _, slot, _ in moves:
                self.memory[tier].free(slot)
            raise
        moved = []
        with self.held_batched():
            for key, entry, slot, pins in moves:
                if self.index.get(key) is entry and entry.pins <= pins:
                    self._relocate(key, entry, tier, slot)
                    moved.append(key)
                else:
                    self.memory[tier].free(slot)
        return moved

    def _relocate(self, key: PageKey, entry: Entry, tier: int, slot: int) -> None:
        self.policies[entry.tier].on_remove(key)
        self._free_slot(entry)
        self._count(entry, -1)
        entry.tier, entry.slot = tier, slot
        self._count(entry, 1)
        self.policies[tier].on_insert(key)
        self._on_event(key, tier)

    def _free_slot(self, entry: Entry) -> None:
        if entry.tier == DISK:
            self.disk.free(entry.slot)
        else:
            self.memory[entry.tier].free(entry.slot)

    async def _write_disk(self, keys: list[PageKey]) -> list[PageKey]:
        items, moved = [], []
        for key in keys:
            slot = self.disk.alloc()
            if slot is None:
                break
            payload = self._encode(self.index[key])
            items.append((slot, bytes(key), self.codec_id, payload))
            moved.append(key)
        if not items:  # no free slot: nothing tried, so the disk's state is not learned
            return []
        entries = [self.index[key] for key in moved]
        namespaces = [entry.namespace for entry in entries]  # restored after a restart
        # Raw pages hashed when they came in are written with that checksum: no pass over
        # their bytes here (checksums_ahead.py). Encoded ones are hashed as written.
        sums = [entry.checksum if self.codec_id == 0 else None for entry in entries]
        self.inline_checksums += sums.count(None)
        # Durable mode: the batch is fdatasynced before this returns, so the page is on disk
        # for good before _relocate tells anyone so.
        metas = await asyncio.to_thread(self.disk.write_or_free, items, namespaces, sums)
        if metas is None:  # a full or failing disk: these pages are dropped (or kept) instead
            self.disk_retry_s = time.monotonic() + DISK_RETRY_S
            return []
        self.disk_retry_s = 0.0
        with self.held_batched():
            for (slot, _, codec, _), key, entry, meta in zip(items, moved, entries, metas,
                                                            strict=True):
                entry.checksum = meta.checksum if codec == 0 else None
                self._relocate(key, entry, DISK, slot)
                entry.codec = codec
        return moved

    def _encode(self, entry: Entry) -> np.ndarray:
        page_bytes = self.geometry.page_bytes
        raw = self.view(entry)[:page_bytes].cpu()
        if self.codec_id == 0:
            return raw.numpy()  # the slot stays MOVING until the write lands
        page = raw.view(self.geometry.torch_dtype()).view(self.geometry.shape)
        return quant.encode_page(page, quant.codec_name(self.codec_id))

    async def promote_many(self, keys: list[PageKey], own_pins: int = 0) -> None:
        """Move host pages up to the device tier, in one batch (one demotion pass).

        A memory page pinned by someone else is left where it is: moving it would free the
        slot under that reader. `own_pins` are the caller's pins, which it can account for.
        Each namespace stays within its max in the device tier, as its puts do: its own
        least valuable device pages make the room, and what they cannot stays in host
        (namespace_max.admitted_into).
        """
        if self.top_tier == HOST:
            return
        movable = [k for k in dict.fromkeys(keys) if self._movable(k, own_pins)]
        if not movable:
            return
        for key in movable:
            self.index[key].state = State.MOVING
        pins = {key: self.index[key].pins for key in movable}  # before make_room's awaits
        try:
            async with self.room_lock:  # as a read-up's (disk_loads.py): room not split
                admitted, _ = await admitted_into(self, DEVICE, movable, keep_unmoved=True)
                await self.make_room(DEVICE, min(len(admitted), self._num_slots(DEVICE)),
                                     keep_unmoved=True)
                await self._move_memory(admitted[: self._free_slots(DEVICE)], DEVICE, pins)
        finally:
            for key in movable:
                if key in self.index:
                    self.index[key].state = State.READY

    def _movable(self, key: PageKey, own_pins: int) -> bool:
        entry = self.index.get(key)
        return (entry is not None and entry.tier == HOST and entry.state == State.READY
                and entry.pins <= own_pins)

    def drop(self, key: PageKey) -> None:
        """Forget a page entirely (evicted from the last tier, or corrupt)."""
        entry = self.index.pop(key, None)
        if entry is None:
            return
        self.policies[entry.tier].on_remove(key)
        self._free_slot(entry)
        self._count(entry, -1)
        if entry.state != State.PENDING:
            self._on_event(key, None)
