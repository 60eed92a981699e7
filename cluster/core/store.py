"""NodeStore: everything one node holds, as a pure object owned by the node actor.

It keeps one Pool per page geometry and two kinds of lease, each with a deadline so that a
client that dies mid-call cannot hold anything forever:

    read lease     acquire() pins pages   -> release(lease_id), or expiry unpins them
    reservation    reserve() holds slots  -> commit/abort(reservation_id), or expiry aborts
                   (a slot whose writer may still copy in is quarantined: pool.abort)

Every change of what the node holds is reported to `on_event(key, tier or None)`; the node
actor sequences those events to the directory (cluster/core/events.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from cluster.core.elastic import ElasticMemory
from cluster.core.faults import DiskFaults
from cluster.core.geometry import DEVICE, DISK, HOST, TIER_NAMES, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.pins import PinSet
from cluster.core.pool import EventSink, Pool, PoolLimits, State
from cluster.core.put_leases import LeaseReply, LeaseRequest, PutLeases
from cluster.core.store_files import read_pool_file, write_pool_file
from cluster.core.store_growth import grow_ahead
from cluster.core.store_stats import memory_by_model, store_stats
from cluster.core.tiers.aligned import make_private_dir
from cluster.core.tiers.disk import DiskArena
from cluster.core.tiers.memory import ArenaDescriptor, reap_retired, remove_stale_shm
from policies.quota import Quota

log = logging.getLogger("raykv.store")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Per-node settings of a NodeStore."""

    limits: PoolLimits
    disk_dir: str
    pin_lease_s: float = 30.0
    disk_threads: int = 4
    max_geometries: int = 16
    reserve_lease_s: float = 30.0
    chunk_bytes: int = 64 << 20
    disk_durability: str = "durable"  # or "volatile": see cluster/core/tiers/disk.py
    max_pinned_fraction: float = 0.5  # of the node's memory (device + host) operators may pin


@dataclass(slots=True)
class Lease:
    """A read lease (pins) or a reservation (pending slots), with its deadline."""

    geometry: PageGeometry
    keys: list[PageKey]
    deadline_s: float
    num_disk: int = 0  # a read lease's pages that were read up from disk for it


def shm_bytes_per_node(limits: PoolLimits) -> int:
    """Shared memory the node's memory tiers may hold at most: the host budget, and the
    device one where it is a CPU stand-in (every pool draws from these; slabs are sparse)."""
    return limits.host_bytes + (0 if limits.use_cuda else limits.device_bytes)


class NodeStore:
    """All pools of one node, plus read leases and reservations."""

    def __init__(self, config: StoreConfig, on_event: EventSink):
        self.config = config
        remove_stale_shm(config.limits.shm_prefix)
        self.pools: dict[PageGeometry, Pool] = {}
        limits = config.limits
        self.elastic = ElasticMemory(limits.device_bytes, limits.host_bytes, limits.disk_bytes,
                                     config.chunk_bytes)
        self.model_names: dict[str, str] = {}  # pool holder (geometry name) -> model names
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Lease] = {}
        self._on_event = on_event
        self._lease_ids = itertools.count(1)
        self.disk_faults: DiskFaults | None = None  # test-only (cluster/core/faults.py)
        self.pins = PinSet()  # operators' pins, over every pool of the node
        self.put_leases = PutLeases(config.reserve_lease_s)  # leased puts: put_leases.py
        self._tasks: set[asyncio.Task] = set()  # work scheduled on the node's loop
        self.counters = {"puts": 0, "gets": 0, "hits_pages": 0, "misses_pages": 0,
                         "hits_device": 0, "hits_host": 0, "hits_disk": 0,
                         "expired_reservations": 0, "expired_leases": 0,
                         "quarantine_freed_slots": 0,
                         "optimistic_hits_pages": 0, "optimistic_reads": 0}

    # ---- pools ---------------------------------------------------------------------------

    def pool(self, geometry: PageGeometry) -> Pool:
        """The pool for a geometry, created on first use; every pool draws from the node's
        shared tier budgets. Past `max_geometries` pools a new one is a ValueError."""
        pool = self.pools.get(geometry)
        if pool is None:
            geometry.validate()
            self._check_fits(geometry)
            if len(self.pools) >= self.config.max_geometries:
                raise ValueError(
                    f"this node already holds {len(self.pools)} page geometries (the "
                    f"max_geometries limit); refusing {geometry.name}")
            pool = self.pools[geometry] = self._make_pool(geometry)
        return pool

    def _check_fits(self, geometry: PageGeometry) -> None:
        """ValueError when one page of `geometry` fits in none of this node's tiers (and any
        has room at all): every put of that model would store nothing."""
        limits = self.config.limits
        capacities = {"device": limits.device_bytes, "host": limits.host_bytes,
                      "disk": limits.disk_bytes}
        if not any(capacities.values()) or self._disk_holds(geometry) or any(
                capacities[tier] >= geometry.slot_bytes for tier in ("device", "host")):
            return
        held = ", ".join(f"{tier} {capacity:,}" for tier, capacity in capacities.items())
        raise ValueError(f"a page of {geometry.name} is {geometry.slot_bytes:,} bytes, more "
                         f"than any tier of this node holds ({held} bytes): nothing of it "
                         f"could be stored; use fewer page_tokens or larger tiers")

    def _disk_holds(self, geometry: PageGeometry) -> bool:
        """Whether the disk tier holds a page of `geometry` (a slot and its 4 KiB header)."""
        return self.config.limits.disk_bytes >= geometry.slot_bytes + 4096

    def _make_pool(self, geometry: PageGeometry) -> Pool:
        limits, holder = self.config.limits, geometry.name
        disk = None
        if self._disk_holds(geometry):
            disk = self._open_disk(os.path.join(self.config.disk_dir, geometry.name), geometry)
        shares = (self.elastic.share(DEVICE, holder, geometry.slot_bytes),
                  self.elastic.share(HOST, holder, geometry.slot_bytes))
        pool = Pool(geometry, limits, disk, self._on_event, shares)
        pool.held = self.pins
        self.put_leases.attach(pool)
        self.elastic.attach(holder, pool)
        return pool

    def _open_disk(self, path: str, geometry: PageGeometry) -> DiskArena:
        """The pool's slabs; slabs laid out for another capacity are discarded, loudly."""
        make_private_dir(path)
        share = self.elastic.share(DISK, geometry.name, geometry.slot_bytes + 4096)
        args = (path, self.config.limits.disk_bytes, geometry.page_bytes, self.config.disk_threads,
                share)
        try:
            disk = DiskArena(*args)
        except ValueError as mismatch:
            log.warning("discarding cached pages in %s, laid out for another capacity: %s",
                        path, mismatch)
            shutil.rmtree(path)
            make_private_dir(path)
            disk = DiskArena(*args)
        write_pool_file(path, geometry)
        disk.set_durability(self.config.disk_durability)
        disk.faults = self.disk_faults
        return disk

    def set_disk_faults(self, faults: DiskFaults | None) -> None:
        """Test-only: inject disk latency or write errors into every pool (None: off)."""
        self.disk_faults = faults
        for pool in self.pools.values():
            if pool.disk is not None:
                pool.disk.faults = faults
            pool.beat_held()  # with faults on, the disk index reads as stale from now on

    def recover_disk(self) -> int:
        """Re-open every pool found on disk and index its verified pages."""
        if not os.path.isdir(self.config.disk_dir):
            return 0
        found = 0
        for name in sorted(os.listdir(self.config.disk_dir)):
            geometry = read_pool_file(os.path.join(self.config.disk_dir, name))
            if geometry is None or (geometry not in self.pools
                                    and len(self.pools) >= self.config.max_geometries):
                continue
            pool = self.pool(geometry)
            if pool.disk is not None:
                found += pool.adopt_disk_pages(pool.disk.scan())
        return found

    def descriptors(self, geometry: PageGeometry) -> list[ArenaDescriptor]:
        """What a same-node client maps: each memory tier, with the pool's held-pages index."""
        pool = self.pool(geometry)
        disk = {} if pool.disk_held is None else {"disk_held_path": pool.disk_held.path,
                                                    "disk_dir": pool.disk.dir_path,
                                                    "disk_threads": pool.disk.num_threads}
        return [dataclasses.replace(arena.descriptor(), held_path=pool.held_index.path, **disk)
                for arena in pool.memory]

    def beat(self) -> None:
        """Stamp every pool's held-pages index: its readers trust it a while after this; and
        free the device chunks released while a client mapped them, once it has let go."""
        for pool in self.pools.values():
            pool.beat_held()
            reap_retired(pool.memory)

    def layout_version(self, geometry: PageGeometry) -> int:
        """Grows whenever a client must map the pool's arenas again (a device chunk granted
        or released); clients compare it with what they mapped (cluster/slabs.py)."""
        pool = self.pools.get(geometry)
        return sum(arena.layout_version for arena in pool.memory) if pool is not None else 0

    # ---- puts ----------------------------------------------------------------------------

    async def reserve(self, geometry: PageGeometry, keys: list[PageKey],
                      tier: int | None = None, namespace: str = ""
                      ) -> tuple[int, list[tuple[int, int] | None]]:
        """(reservation_id, slots): see Pool.reserve. The reservation expires after
        reserve_lease_s unless committed or aborted first."""
        self.expire()  # a dead reader's pins or a dead writer's slots must not keep puts out
        if self.elastic.over_max_pending:  # a max lowered with no loop to give it back on
            await self.elastic.give_back_over_max()
        reservation_id = next(self._lease_ids)
        slots = await self.pool(geometry).reserve(keys, reservation_id, tier, namespace)
        mine = [key for key, slot in zip(keys, slots, strict=False) if slot is not None]
        if mine:
            deadline_s = time.monotonic() + self.config.reserve_lease_s
            self.reservations[reservation_id] = Lease(geometry, mine, deadline_s)
        return reservation_id, slots

    async def grow_ahead(self, geometry: PageGeometry) -> int:
        """Ready memory chunks ahead of need for the geometry's pool (store_growth.py);
        returns how many were readied."""
        pool = self.pools.get(geometry)
        return 0 if pool is None else await grow_ahead(pool, geometry, self.put_leases)

    def has(self, geometry: PageGeometry, key: PageKey) -> bool:
        """Whether a ready copy of the page is here (any tier)."""
        pool = self.pools.get(geometry)
        return pool is not None and pool.local_prefix([key]) == 1

    def commit(self, reservation_id: int) -> int:
        """Make a reservation's pages visible; 0 when it expired (its slots are gone)."""
        lease = self.reservations.pop(reservation_id, None)
        if lease is None:
            return 0
        self.counters["puts"] += 1
        return self.pool(lease.geometry).commit(lease.keys, reservation_id)

    def abort(self, reservation_id: int) -> None:
        lease = self.reservations.pop(reservation_id, None)
        if lease is not None:
            self.pool(lease.geometry).abort(lease.keys, reservation_id)

    def truncate(self, reservation_id: int, keys: list[PageKey]) -> None:
        """Abort these keys of a reservation (their bytes never arrived); keep the rest."""
        lease = self.reservations.get(reservation_id)
        if lease is None or not keys:
            return
        self.pool(lease.geometry).abort(keys, reservation_id)
        dropped = set(keys)
        lease.keys = [key for key in lease.keys if key not in dropped]

    async def put_leased(self, geometry: PageGeometry, request: LeaseRequest) -> LeaseReply:
        """Commit a client's leased writes and top its slot lease up (core/put_leases.py)."""
        self.expire()
        reply = await self.put_leases.call(self.pool(geometry), request, next(self._lease_ids))
        if any(reply.committed):
            self.counters["puts"] += 1
        return reply

    def end_put_lease(self, lease_id: int) -> int:
        """A client gives its leased slots back; returns how many."""
        return self.put_leases.end(self.pools, lease_id)

    async def put_pages(self, geometry: PageGeometry, keys: list[PageKey],
                        pages: list[np.ndarray], tier: int | None = None,
                        namespace: str = "") -> int:
        """Store pages whose bytes arrived through Ray (remote or non-mapping clients).

        Only the keys this call reserved are written and committed (a key that another put
        holds reserved is that put's to commit); a bad page aborts them all.
        """
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        reservation_id, reserved = await self.reserve(geometry, keys, tier, namespace)
        if not reserved:
            return 0
        pool = self.pool(geometry)
        keys = keys[: len(reserved)]
        try:
            for key, slot, page in zip(keys, reserved, pages[: len(reserved)], strict=True):
                if slot is not None:
                    pool.write_page(key, page)
        except BaseException:
            self.abort(reservation_id)
            raise
        self.commit(reservation_id)
        return len(reserved)  # the prefix now stored, ours or already there

    # ---- gets ----------------------------------------------------------------------------

    async def acquire(self, geometry: PageGeometry, keys: list[PageKey]):
        """Pin the longest local prefix; returns (lease_id, [(tier, slot, generation), ...])."""
        self.expire()
        pool = self.pool(geometry)
        tiers_before = [pool.index[k].tier for k in keys[: pool.local_prefix(keys)]]
        located = await pool.acquire(keys)
        hits = np.bincount(np.asarray(tiers_before[: len(located)], dtype=np.int64),
                           minlength=len(TIER_NAMES))
        for tier in np.flatnonzero(hits).tolist():  # where the hits were, before promotion
            self.counters[f"hits_{TIER_NAMES[tier]}"] += int(hits[tier])
        self.counters["gets"] += 1
        self.counters["hits_pages"] += len(located)
        self.counters["misses_pages"] += len(keys) - len(located)
        if not located:
            return 0, []
        lease_id = next(self._lease_ids)
        deadline_s = time.monotonic() + self.config.pin_lease_s
        self.leases[lease_id] = Lease(geometry, keys[: len(located)], deadline_s,
                                      int(hits[DISK]))
        return lease_id, located

    def release(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.pool(lease.geometry).release(lease.keys)

    async def touch(self, geometry: PageGeometry, keys: list[PageKey], num_reads: int = 1) -> int:
        """Count reads that clients made without a lease (optimistic, generation-checked, or
        from the disk tier's slab files: cluster/disk_direct.py): the eviction policy sees
        them as accesses, and they move up a tier as an acquire's pages do (disk pages are
        read up into host, as an acquire reads them). Returns how many pages are still
        here."""
        pool = self.pools.get(geometry)
        if pool is None:
            return 0
        tiers = pool.touch(keys)
        if DISK in tiers:
            await pool.load_from_disk(keys, keep_unmoved=True)
        await pool.promote_many(keys)
        for tier in tiers:
            self.counters[f"hits_{TIER_NAMES[tier]}"] += 1
        found = len(tiers)
        self.counters["optimistic_hits_pages"] += found
        self.counters["optimistic_reads"] += num_reads
        self.counters["hits_pages"] += found
        return found

    def expire(self, now_s: float | None = None) -> int:
        """Release read leases and abort reservations past their deadline; returns how many."""
        now_s = time.monotonic() if now_s is None else now_s
        leases = [i for i, lease in self.leases.items() if lease.deadline_s < now_s]
        reservations = [i for i, r in self.reservations.items() if r.deadline_s < now_s]
        for lease_id in leases:
            self.release(lease_id)
        for reservation_id in reservations:
            self.abort(reservation_id)  # its slots are fenced; a late writer's quarantined
        self.put_leases.expire(self.pools, now_s)  # before the quarantine: freed at once
        for pool in self.pools.values():
            self.counters["quarantine_freed_slots"] += pool.release_quarantined()
        self.pins.sweep()
        self.counters["expired_leases"] += len(leases)
        self.counters["expired_reservations"] += len(reservations)
        return len(leases) + len(reservations)

    async def map_pages(self, geometry: PageGeometry, keys: list[PageKey],
                        fn: Callable[[np.ndarray], T]) -> list[T]:
        """fn(bytes of the page) for each page of the longest local prefix, while it is pinned.

        `fn` gets a view into the slab: it must copy what it keeps (np.copy, ray.put).
        """
        lease_id, located = await self.acquire(geometry, keys)
        pool = self.pool(geometry)
        try:
            return [fn(pool.memory[tier].view(slot)[: geometry.page_bytes].cpu().numpy())
                    for tier, slot, _ in located]
        finally:
            self.release(lease_id)

    async def prefetch(self, geometry: PageGeometry, keys: list[PageKey]) -> int:
        """Promote the local prefix toward the top tier; returns pages now in memory."""
        pool = self.pool(geometry)
        count = pool.local_prefix(keys)
        await pool.load_from_disk(keys[:count], keep_unmoved=True)
        await pool.promote_many(keys[:count])
        return sum(1 for k in keys[:count] if k in pool.index and pool.index[k].tier < DISK)

    # ---- operators' pins -------------------------------------------------------------------

    def pin_cap_bytes(self) -> int:
        """The most that operators' pins may hold here: a fraction of the memory tiers."""
        memory_bytes = sum(self.elastic.budgets[t].capacity_bytes for t in (DEVICE, HOST))
        return int(self.config.max_pinned_fraction * memory_bytes)

    def pin(self, geometry: PageGeometry, pin_id: bytes, keys: list[PageKey],
            ttl_s: float) -> tuple[list[PageKey], tuple[list[PageKey], float] | None]:
        """Pin the pages among `keys` stored here for `ttl_s` (replacing the pin `pin_id`):
        (the keys pinned, the pin replaced as (its keys, its seconds left) or None).
        PinRefused past the cap: nothing is pinned then."""
        pool = self.pools.get(geometry)
        stored = [k for k in dict.fromkeys(keys) if pool is not None and k in pool.index
                  and pool.index[k].state != State.PENDING]
        pages = {key: geometry.slot_bytes for key in stored}
        old = self.pins.pin(pin_id, pages, ttl_s, self.pin_cap_bytes())
        return stored, None if old is None else (list(old.pages), self.pins.remaining_s(old))

    def unpin(self, pin_id: bytes) -> list[PageKey]:
        """End the pin `pin_id` now; returns the keys it held."""
        return self.pins.unpin(pin_id)

    # ---- rebalancing (the control loop) --------------------------------------------------

    def geometry_of(self, key: PageKey) -> PageGeometry | None:
        """The geometry of the pool that holds `key`, or None."""
        return next((g for g, pool in self.pools.items() if key in pool.index), None)

    def discard(self, geometry: PageGeometry, keys: list[PageKey]) -> int:
        """Drop the ready, unpinned pages among `keys` (they moved to another node); pages
        being read or written stay. Returns how many were dropped."""
        pool = self.pools.get(geometry)
        if pool is None:
            return 0
        victims = [key for key in keys if not pool.is_pinned(key)]
        for key in victims:
            pool.drop(key)
        return len(victims)

    # ---- inventory and stats -------------------------------------------------------------

    def inventory(self) -> list[tuple[PageKey, int]]:
        """Every ready page as (key, tier): lets a restarted directory rebuild its index."""
        return [(key, entry.tier) for pool in self.pools.values()
                for key, entry in pool.index.items() if entry.state != State.PENDING]

    def stats(self) -> dict:
        """Pages and bytes by tier, memory, evictions, leases, disk and pin counters."""
        return store_stats(self)

    def set_quotas(self, models: dict[str, Quota], namespaces: dict[str, Quota],
                   model_names: dict[str, str] | None = None) -> None:
        """Quotas at run time: by pool (a page geometry's name) and by namespace. A pool or
        namespace now over a lowered max gives the excess back at once, on the running loop
        (the node actor's, which applies registry pushes); with none, before the next
        reserve. What pages in use hold back goes at a later tick (shrink_idle)."""
        self.elastic.set_quotas(models, namespaces)
        self.model_names = dict(model_names or {})
        if self.elastic.over_max_pending:
            self._soon(self.elastic.give_back_over_max())

    def _soon(self, work) -> None:
        """Run a coroutine on the running loop, off the caller's path (failures are logged);
        with no loop running it is not run (a later call does the work)."""
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:
            work.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduled store work failed", exc_info=task.exception())

    async def demote_ahead(self) -> int:
        """Every pool keeps its learned host headroom free (cluster/core/demote_ahead.py);
        returns the pages demoted."""
        return sum([await pool.demote_ahead() for pool in list(self.pools.values())])

    async def checksum_ahead(self) -> int:
        """Every pool hashes its next batch of host pages that have no checksum yet, so that
        their demotion only writes (cluster/core/checksums_ahead.py); returns how many."""
        return sum([await pool.checksum_ahead() for pool in list(self.pools.values())])

    async def shrink_idle(self, idle_s: float) -> int:
        """Pools unused for `idle_s` give their memory chunks back; returns how many. First,
        every pool zeroes the headers of the disk slots it freed since its last flush (the
        node's periodic tidy): a page discarded a moment ago stays gone after a restart; and
        a pool or namespace over a lowered max gives back what pages in use held back."""
        for pool in list(self.pools.values()):
            await pool.flush_disk_frees()
        if self.elastic.is_over_max():
            await self.elastic.give_back_over_max()
        return await self.elastic.shrink_idle(time.monotonic(), idle_s)

    def memory_by_model(self) -> dict[str, int]:
        """Bytes each model holds across the tiers (pools named by their models)."""
        return memory_by_model(self.elastic, self.model_names)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
