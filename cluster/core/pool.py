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

Pool is this module's index and tiers, plus one mixin per job: puts (pool_puts.py), gets
(pool_gets.py), moves between tiers (pool_moves.py), disk reads (disk_loads.py), leased puts
(put_leases.py), demotion ahead (demote_ahead.py) and checksums ahead (checksums_ahead.py). The
names that moved out stay importable from here: the `name as name` imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable

import torch

from cluster.core import quant
from cluster.core.checksums_ahead import ChecksumsAhead
from cluster.core.claims import InflightClaims
from cluster.core.demote_ahead import DemoteAhead, RecentPeak
from cluster.core.disk_loads import DiskLoads
from cluster.core.elastic import Elastic
from cluster.core.elastic import guarded_victims as guarded_victims
from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.namespace_max import within_namespace_max as within_namespace_max
from cluster.core.pins import PinSet
from cluster.core.pool_entry import Entry, State
from cluster.core.pool_gets import MAX_LOAD_ROUNDS as MAX_LOAD_ROUNDS
from cluster.core.pool_gets import PinnedGets
from cluster.core.pool_limits import PoolLimits
from cluster.core.pool_moves import TierMoves
from cluster.core.pool_puts import ReservedPuts
from cluster.core.put_leases import LeasedSlots
from cluster.core.tiers.chunks import ChunkedSlots, Share
from cluster.core.tiers.device_copy import tier_copies as tier_copies
from cluster.core.tiers.disk import DiskArena
from cluster.core.tiers.fence import SlotFence
from cluster.core.tiers.held_index import HeldIndex
from cluster.core.tiers.memory import ArenaOptions, MappedArena
from cluster.core.tiers.memory import readonly_tensor as readonly_tensor
from policies.eviction import make_policy

EventSink = Callable[[PageKey, int | None], None]
DISK_HELD_MAX_SLOTS = 1 << 17  # the disk-held index's entries: 512 Ki, 32 MiB of shared memory


class Pool(ReservedPuts, PinnedGets, TierMoves, DiskLoads, LeasedSlots, DemoteAhead,
           ChecksumsAhead):
    """Pages of one geometry on one node."""

    def __init__(self, geometry: PageGeometry, limits: PoolLimits, disk: DiskArena | None,
                 on_event: EventSink, shares: tuple[Share | None, Share | None] = (None, None)):
        self.geometry = geometry
        self.codec_id = quant.codec_id(limits.disk_codec)
        self.memory = _memory_tiers(geometry.slot_bytes, limits, shares)
        self.disk = disk
        self._init_index()
        # A tier may be absent (no VRAM, no disk): its policy then stays empty.
        self.policies = [make_policy(limits.eviction, max(1, self._num_slots(t)))
                         for t in range(3)]
        self._sink = on_event
        # What the mapped tiers hold, for the clients on this node: a get of pages put by
        # another client reads them with no call (tiers/held_index.py). Every change of a
        # page's place goes through _on_event, which keeps it current.
        self.held_index = HeldIndex(limits.shm_prefix,
                                    sum(arena.num_slots for arena in self.memory))
        # Its disk pages too, in an index of their own (so that they never crowd out the
        # memory tiers' entries): a client reads those from the slab files with no call
        # (tiers/disk_reader.py). Past DISK_HELD_MAX_SLOTS the index is full and overwrites:
        # such a page is asked for, as any page missing from an index is.
        self.disk_held = (HeldIndex(limits.shm_prefix,
                                    min(disk.num_slots, DISK_HELD_MAX_SLOTS))
                          if disk is not None else None)
        self._loads = InflightClaims()
        self.top_tier = DEVICE if self.memory[DEVICE].num_slots else HOST
        self._init_fences()
        self._init_room()

    def _init_index(self) -> None:
        """The local index and its counters."""
        self.index: dict[PageKey, Entry] = {}
        self.elastic = Elastic()
        self.ns_pages: Counter[tuple[int, str]] = Counter()  # (tier, namespace) -> pages
        self.last_access_s = time.monotonic()
        self.evictions = [0, 0, 0]  # pages demoted out of each tier
        self.disk_read_us_per_token = 0.0  # recent disk reads (EWMA): the paging tax's part
        self.disk_read_s = 0.0  # all the batched reads up from disk took, wall time

    def _init_fences(self) -> None:
        """The write fences on the memory tiers' slots, and the pins that keep pages."""
        # Two opens of each memory tier's generation file: the node's fence on reserved slots
        # that go back, and its own writers' locks (a pull's thread): distinct lock owners.
        self.fences = [SlotFence(arena.descriptor().generations_path) for arena in self.memory]
        self.own_writes = [SlotFence(arena.descriptor().generations_path)
                           for arena in self.memory]
        self.quarantined: list[tuple[int, int]] = []  # (tier, slot) a late writer may hold
        self.held = PinSet()  # operator pins (the node's, shared by its pools: NodeStore)

    def _init_room(self) -> None:
        """How room is made: one maker at a time, ahead of need, and pages hashed ahead."""
        # Held by whoever makes room (a reserve, a read-up, a promotion, the pass ahead) from
        # making it to taking the slots, so that no one else takes the room made meanwhile
        # and both come up short; a lease top-up takes no slot while it is held.
        self.room_lock = asyncio.Lock()
        # Batches that leaned on the host tier's free room, and the pages demoted ahead of
        # them between requests (demote_ahead.py).
        self.host_peak = RecentPeak()
        self.demoted_ahead = 0
        self.disk_retry_s = 0.0  # a failed disk write's wait (pool_moves.DISK_RETRY_S)
        self._init_checksums()  # host pages hashed between requests (checksums_ahead.py)

    def _on_event(self, key: PageKey, tier: int | None) -> None:
        """A page stored, moved or dropped: published to (or withdrawn from) the held-pages
        indexes for this node's clients, then reported (the node tells the directory)."""
        entry = self.index.get(key)
        here = tier is not None and entry is not None and entry.tier == tier
        if here and tier != DISK:
            self.held_index.publish([key], [(tier, entry.slot,
                                             self.memory[tier].generation(entry.slot))])
        else:
            self.held_index.withdraw([key])
        if self.disk_held is not None:
            if here and tier == DISK:  # no generation: the page's header names its key
                self.disk_held.publish([key], [(DISK, entry.slot, 0)])
            else:
                self.disk_held.withdraw([key])
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

    @contextlib.contextmanager
    def held_batched(self):
        """Both held-pages indexes' changes written at the end, in one pass each (see
        HeldIndex.batched)."""
        with self.held_index.batched():
            if self.disk_held is None:
                yield
                return
            with self.disk_held.batched():
                yield

    def beat_held(self) -> None:
        """Stamp the held-pages indexes: readers trust them a while after this. Not the disk
        pages' while a test injects disk faults (cluster/core/faults.py): clients then ask for
        those pages, and the node's reads, which the faults slow or fail, serve them."""
        self.held_index.beat()
        if self.disk_held is not None:
            if self.disk is not None and self.disk.faults is not None:
                self.disk_held.expire()
            else:
                self.disk_held.beat()

    def close(self) -> None:
        self.held_index.close()
        if self.disk_held is not None:
            self.disk_held.close()
        for fence in self.fences + self.own_writes:
            fence.close()
        for arena in self.memory:
            arena.close()
        if self.disk is not None:
            self.disk.close()


def _memory_tiers(slot_bytes: int, limits: PoolLimits,
                  shares: tuple[Share | None, Share | None]) -> list[MappedArena]:
    """The device and host tiers of a pool, in that order (DEVICE, HOST)."""
    return [
        MappedArena("device", limits.device_bytes, slot_bytes,
                    ArenaOptions(limits.use_cuda, limits.shm_prefix, shares[DEVICE],
                                 limits.num_devices)),
        MappedArena("host", limits.host_bytes, slot_bytes,
                    ArenaOptions(False, limits.shm_prefix, shares[HOST])),
    ]
