"""One page size class on one node: three tiers, the local index, eviction and pins.

    device (VRAM)  --demote-->  host (/dev/shm)  --demote-->  disk (O_DIRECT)  --> dropped
          ^------------promote on access--------------------------'

Each page lives in exactly one tier. Copies between the memory tiers run in a copy thread (on
a CUDA stream where the device tier is VRAM: tiers/device_copy.py) and disk I/O in the disk
arena's threads; both are awaited, off the owner's event loop. A page that is pinned (being read,
or held by an operator's pin: cluster/core/pins.py) or moving between tiers is never chosen as
a victim.

A reserved memory slot is written by someone else (a client, a pull's thread), so it goes back
only through its write fence (tiers/fence.py): a slot whose writer may still be copying in
when its reservation ends is quarantined, and freed once that writer is done or dead.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from cluster.core import quant
from cluster.core.checksums_ahead import ChecksumsAhead
from cluster.core.claims import InflightClaims
from cluster.core.demote_ahead import DemoteAhead, RecentPeak
from cluster.core.disk_loads import DiskLoads
from cluster.core.elastic import Elastic, guarded_victims, within_namespace_max
from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.pins import PinSet
from cluster.core.pool_entry import Entry, State
from cluster.core.pool_limits import PoolLimits
from cluster.core.put_leases import LeasedSlots
from cluster.core.tiers.chunks import ChunkedSlots, Share
from cluster.core.tiers.device_copy import tier_copies
from cluster.core.tiers.disk import DiskArena
from cluster.core.tiers.fence import SlotFence
from cluster.core.tiers.held_index import HeldIndex
from cluster.core.tiers.memory import ArenaOptions, MappedArena, readonly_tensor
from policies.eviction import make_policy

EventSink = Callable[[PageKey, int | None], None]
MAX_LOAD_ROUNDS = 3


class Pool(DiskLoads, LeasedSlots, DemoteAhead, ChecksumsAhead):
    """Pages of one geometry on one node."""

    def __init__(self, geometry: PageGeometry, limits: PoolLimits, disk: DiskArena | None,
                 on_event: EventSink, shares: tuple[Share | None, Share | None] = (None, None)):
        self.geometry = geometry
        self.codec_id = quant.codec_id(limits.disk_codec)
        slot_bytes = geometry.slot_bytes
        self.memory = [
            MappedArena("device", limits.device_bytes, slot_bytes,
                        ArenaOptions(limits.use_cuda, limits.shm_prefix, shares[DEVICE],
                                     limits.num_devices)),
            MappedArena("host", limits.host_bytes, slot_bytes,
                        ArenaOptions(False, limits.shm_prefix, shares[HOST])),
        ]
        self.disk = disk
        self.index: dict[PageKey, Entry] = {}
        self.elastic = Elastic()
        self.ns_pages: Counter[tuple[int, str]] = Counter()  # (tier, namespace) -> pages
        self.last_access_s = time.monotonic()
        self.evictions = [0, 0, 0]  # pages demoted out of each tier
        self.disk_read_us_per_token = 0.0  # recent disk reads (EWMA): the paging tax's part
        # A tier may be absent (no VRAM, no disk): its policy then stays empty.
        self.policies = [make_policy(limits.eviction, max(1, self._num_slots(t)))
                         for t in range(3)]
        self._sink = on_event
        # What the mapped tiers hold, for the clients on this node: a get of pages put by
        # another client reads them with no call (tiers/held_index.py). Every change of a
        # page's place goes through _on_event, which keeps it current.
        self.held_index = HeldIndex(limits.shm_prefix,
                                    sum(arena.num_slots for arena in self.memory))
        self._loads = InflightClaims()
        self.top_tier = DEVICE if self.memory[DEVICE].num_slots else HOST
        # Two opens of each memory tier's generation file: the node's fence on reserved slots
        # that go back, and its own writers' locks (a pull's thread): distinct lock owners.
        self.fences = [SlotFence(arena.descriptor().generations_path) for arena in self.memory]
        self.own_writes = [SlotFence(arena.descriptor().generations_path)
                           for arena in self.memory]
        self.quarantined: list[tuple[int, int]] = []  # (tier, slot) a late writer may hold
        self.held = PinSet()  # operator pins (the node's, shared by its pools: NodeStore)
        # Held by a reserve and a lease's top-up from making room to taking the slots, so that
        # two of them (one client's lease top-up and its own put's reserve) never split the
        # room made between them and both come up short.
        self.room_lock = asyncio.Lock()
        # Batches that leaned on the host tier's free room, and the pages demoted ahead of
        # them between requests (demote_ahead.py).
        self.host_peak = RecentPeak()
        self.demoted_ahead = 0
        self._init_checksums()  # host pages hashed between requests (checksums_ahead.py)

    def _on_event(self, key: PageKey, tier: int | None) -> None:
        """A page stored, moved or dropped: published to (or withdrawn from) the held-pages
        index for this node's clients, then reported (the node tells the directory)."""
        entry = self.index.get(key)
        if tier is not None and tier != DISK and entry is not None and entry.tier == tier:
            self.held_index.publish([key], [(tier, entry.slot,
                                             self.memory[tier].generation(entry.slot))])
        else:
            self.held_index.withdraw([key])
        self._queue_checksum(key, entry, tier)
        self._sink(key, tier)

    def _num_slots(self, tier: int) -> int:
        if tier == DISK:
            return self.disk.num_slots if self.disk else 0
        return self.memory[tier].num_slots

    def _free_slots(self, tier: int) -> int:
        if tier == DISK:
            return self.disk.num_free if self.disk else 0
        return self.memory[tier].slots.num_free

    def slots(self, tier: int) -> ChunkedSlots | None:
        """The chunked slot space of a tier (None: no disk tier)."""
        if tier == DISK:
            return self.disk.slots if self.disk else None
        return self.memory[tier].slots

    def _count(self, entry: Entry, delta: int) -> None:
        self.ns_pages[(entry.tier, entry.namespace)] += delta

    def is_pinned(self, key: PageKey) -> bool:
        """Not to be evicted: read (a lease's pins), moving, or held by an operator's pin."""
        entry = self.index.get(key)
        return (entry is None or entry.pins > 0 or entry.state != State.READY
                or self.held.holds(key))

    def view(self, entry: Entry) -> torch.Tensor:
        return self.memory[entry.tier].view(entry.slot)

    # ---- reserve / commit (puts) -------------------------------------------------------

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

    # ---- acquire / release (gets) ------------------------------------------------------

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
        """Note an access to each ready memory page among `keys`; returns the tier of each
        one found."""
        self.last_access_s = time.monotonic()
        tiers: list[int] = []
        for key in keys:
            entry = self.index.get(key)
            if entry is not None and entry.state == State.READY and entry.tier != DISK:
                self.policies[entry.tier].on_access(key)
                tiers.append(entry.tier)
        return tiers

    def release(self, keys: list[PageKey]) -> None:
        for key in keys:
            entry = self.index.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    # ---- moving pages between tiers ----------------------------------------------------

    async def make_room(self, tier: int, num_pages: int, namespace: str = "") -> bool:
        """Free up to `num_pages` slots in `tier`: first by revoking unused leased slots
        (put_leases.py), then by taking chunks the node's budget can give (from other pools,
        per the quotas), then by demoting this pool's own unpinned victims, as the namespace
        quotas allow. True when all of it is free."""
        if tier == DISK:  # slots freed since the last flush come back once their headers are zeroed
            await self.flush_disk_frees()
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
            await self.demote(victims, tier)
        return self._free_slots(tier) >= num_pages

    async def demote(self, keys: list[PageKey], tier: int) -> None:
        """Move pages down: into the next tier with room (skipping a full or absent one),
        dropping only what no lower tier can take."""
        self.evictions[tier] += len(keys)
        for key in keys:
            self.index[key].state = State.MOVING
        remaining = list(keys)
        try:
            for below in range(tier + 1, DISK + 1):
                if remaining and self._num_slots(below):
                    remaining = await self._move_down(remaining, below)
        finally:
            for key in keys:
                if key in self.index:
                    self.index[key].state = State.READY
        for key in remaining:  # a page a reader pinned while it was moving stays where it is
            if key in self.index and self.index[key].pins == 0:
                self.drop(key)
        if tier == DISK:  # so that the room (or a chunk) they held is free at once
            await self.flush_disk_frees()

    async def flush_disk_frees(self) -> int:
        """Zero the headers of the disk slots freed since the last flush (in a thread), so
        their pages do not come back after a restart, and hand the slots out again."""
        if self.disk is None or not self.disk.num_freed:
            return 0
        return await asyncio.to_thread(self.disk.flush_freed)

    async def _move_down(self, keys: list[PageKey], below: int) -> list[PageKey]:
        """Move what fits into `below`; returns the keys left over."""
        await self.make_room(below, min(len(keys), self._num_slots(below)))
        room = self._free_slots(below)
        batch, rest = keys[:room], keys[room:]
        if below == DISK:
            moved = set(await self._write_disk(batch))
        else:
            moved = set(await self._move_memory(batch, below))
        return [key for key in batch if key not in moved] + rest

    async def _move_memory(self, keys: list[PageKey], tier: int) -> list[PageKey]:
        """Copy pages into `tier` in one batch, off the event loop, then move those that no
        reader pinned meanwhile (moving one would free its slot under the reader); returns
        the keys moved."""
        moves = []
        for key in keys:
            slot = self.memory[tier].alloc()
            if slot is None:
                break
            entry = self.index[key]
            moves.append((key, entry, slot, entry.pins))
        pairs = [(self.memory[tier].view(slot), self.view(entry)) for _, entry, slot, _ in moves]
        try:
            await tier_copies().copy(pairs)
        except BaseException:
            for _, _, slot, _ in moves:
                self.memory[tier].free(slot)
            raise
        moved = []
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
        entries = [self.index[key] for key in moved]
        namespaces = [entry.namespace for entry in entries]  # restored after a restart
        # Raw pages hashed when they came in are written with that checksum: no pass over
        # their bytes here (checksums_ahead.py). Encoded ones are hashed as written.
        sums = [entry.checksum if self.codec_id == 0 else None for entry in entries]
        self.inline_checksums += sums.count(None)
        # Durable mode: the batch is fdatasynced before this returns, so the page is on disk
        # for good before _relocate tells anyone so.
        metas = await asyncio.to_thread(self.disk.write_or_free, items, namespaces, sums)
        if metas is None:
            return []  # a full or failing disk: these pages are dropped instead
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
        """
        if self.top_tier == HOST:
            return
        movable = [k for k in dict.fromkeys(keys) if self._movable(k, own_pins)]
        if not movable:
            return
        for key in movable:
            self.index[key].state = State.MOVING
        try:
            await self.make_room(DEVICE, min(len(movable), self._num_slots(DEVICE)))
            await self._move_memory(movable[: self._free_slots(DEVICE)], DEVICE)
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

    # ---- restart and stats -------------------------------------------------------------

    def adopt_disk_pages(self, found: list[tuple[int, object]]) -> int:
        """Index pages found on the disk slabs after a restart (already checksum-verified),
        each in the namespace its header names (its quotas apply again).

        A key found twice (a crash before a freed slot's header was zeroed) is indexed once;
        returns how many pages were indexed.
        """
        adopted = 0
        for slot, meta in found:
            key = PageKey(meta.key)
            if key in self.index:
                self.disk.free(slot)
                continue
            entry = self.index[key] = Entry(DISK, slot, State.READY, codec=meta.codec,
                                            namespace=meta.namespace)
            self._count(entry, 1)
            self.policies[DISK].on_insert(key)
            self._on_event(key, DISK)
            adopted += 1
        return adopted

    def tier_counts(self) -> dict[str, int]:
        counts = [0, 0, 0]
        for entry in self.index.values():
            if entry.state != State.PENDING:
                counts[entry.tier] += 1
        return {"device": counts[0], "host": counts[1], "disk": counts[2]}

    def close(self) -> None:
        self.held_index.close()
        for fence in self.fences + self.own_writes:
            fence.close()
        for arena in self.memory:
            arena.close()
        if self.disk is not None:
            self.disk.close()
