"""One elastic memory per node: every pool (model) draws its tiers from one budget each.

    NodeStore -- ElasticMemory -- TierBudget x 3 (device, host, disk)
                     |  quotas: model -> Quota, namespace -> Quota (policies/quota.py)
    Pool(model A) ---+--- reclaim(pool, tier, num_slots): take chunks from another pool
    Pool(model B) ---+--- guard(tier, namespace, page_bytes): whose pages a namespace evicts,
                                                   lower priority classes first

A pool that needs a slot first uses its held chunks, then grows by a chunk while the budget
has room. In a full tier, choose_donor names another pool to give a chunk back (its emptiest
chunks' pages are demoted, the chunks released), or the pool evicts its own pages. A pool
idle for `idle_shrink_s` gives its memory chunks back down to its min. Pure: no Ray.

This module knows a pool only as an `ElasticPool` (the members it uses); cluster/core/pool.py
imports it for the links and the namespace-quota victims, never the other way round.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from cluster.core.geometry import DEVICE, DISK, HOST, TIER_NAMES, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.pool_entry import Entry
from cluster.core.tiers.chunks import ChunkedSlots, Share, TierBudget
from cluster.core.tiers.disk import DiskArena
from policies.eviction import EvictionPolicy
from policies.quota import (
    Holding,
    Quota,
    choose_donor,
    giving_order,
    namespace_guard,
    release_order,
)

log = logging.getLogger("raykv.elastic")
MAX_RECLAIM_ROUNDS = 64  # chunks one request may take from others
MIN_CHUNKS = 8  # a tier is cut into at least this many chunks, so models can share it


@dataclass(slots=True)
class Elastic:
    """A pool's links to the node's shared budgets (ElasticMemory.attach sets them; a pool
    on its own has none). `reclaim(pool, tier, num_slots)` gets room by taking chunks from
    other pools; `guard(tier, namespace, page_bytes)` says whose pages a namespace may evict,
    in rounds (first to give first);
    `room(tier, namespace)` the bytes a namespace may still add under its max."""

    reclaim: Callable[[ElasticPool, int, int], Awaitable[None]] | None = None
    guard: Callable[[int, str, int], tuple[frozenset[str], ...]] | None = None
    room: Callable[[int, str], int | None] | None = None


class ElasticPool(Protocol):
    """What the elastic memory uses of a pool (cluster/core/pool.py's Pool)."""

    elastic: Elastic
    geometry: PageGeometry
    index: dict[PageKey, Entry]
    policies: list[EvictionPolicy]  # one per tier
    ns_pages: Counter[tuple[int, str]]  # (tier, namespace) -> pages
    disk: DiskArena | None
    last_access_s: float

    def is_pinned(self, key: PageKey) -> bool: ...

    def slots(self, tier: int) -> ChunkedSlots | None: ...

    def _free_slots(self, tier: int) -> int: ...

    def revoke_leased(self, tier: int, count: int) -> int: ...

    async def demote(self, keys: list[PageKey], tier: int) -> None: ...


def guarded_victims(pool: ElasticPool, tier: int, count: int, namespace: str) -> list[PageKey]:
    """The pool policy's victims, skipping what the namespace quotas protect and what is
    pinned; namespaces give in rounds (policies/quota.py's giving_order): lower priority
    classes first, and within a class those most over their share."""
    if pool.elastic.guard is None:
        return pool.policies[tier].victims(count, pool.is_pinned)
    rounds = pool.elastic.guard(tier, namespace, pool.geometry.slot_bytes)
    taken: list[PageKey] = []
    for givers in rounds:
        if len(taken) >= count:
            break
        chosen = set(taken)
        taken += pool.policies[tier].victims(
            count - len(taken), lambda k, g=givers, c=chosen: pool.is_pinned(k) or k in c
            or pool.index[k].namespace not in g)
    return taken[:count]


async def within_namespace_max(pool: ElasticPool, tier: int, namespace: str, count: int) -> int:
    """How many of `count` new pages `namespace` may place in `tier` under its max: its own
    least valuable pages there are demoted to make the room. (Pages of other namespaces are
    never evicted for this.)"""
    if pool.elastic.room is None:
        return count
    room_bytes = pool.elastic.room(tier, namespace)
    if room_bytes is None:
        return count
    over = count - room_bytes // pool.geometry.slot_bytes
    if over > 0:
        own = pool.policies[tier].victims(
            over, lambda k: pool.is_pinned(k) or pool.index[k].namespace != namespace)
        if own:
            await pool.demote(own, tier)
        room_bytes = pool.elastic.room(tier, namespace)
    return max(0, min(count, room_bytes // pool.geometry.slot_bytes))


def namespace_room_pages(pool: ElasticPool, tier: int, namespace: str) -> int | None:
    """How many more pages `namespace` may place in `tier` under its max, demoting nothing
    (None: no max)."""
    if pool.elastic.room is None:
        return None
    room_bytes = pool.elastic.room(tier, namespace)
    return None if room_bytes is None else room_bytes // pool.geometry.slot_bytes


async def release_chunks(pool: ElasticPool, tier: int, num_chunks: int,
                         quotas: dict[str, Quota] | None = None) -> int:
    """Give up to `num_chunks` of the pool's chunks in `tier` back to the budget: those of
    lower priority classes' pages first (per the namespace `quotas`), the emptiest among
    equals; their pages are demoted, and a chunk with a page in use is skipped."""
    slots = pool.slots(tier)
    if slots is None:
        return 0
    if tier != DISK:  # leased, unwritten slots are room to give before any page moves
        pool.revoke_leased(tier, slots.num_used)
    # Bounded: chunks emptied meanwhile (by the demotion ahead, or a revoked lease) are not
    # all given back, or an idle pool would drop below its min.
    released = slots.release_empty(num_chunks)
    by_chunk: dict[int, list[PageKey]] = {}
    for key, entry in pool.index.items():
        if entry.tier == tier:
            by_chunk.setdefault(entry.slot // slots.slots_per_chunk, []).append(key)
    chunks = [(chunk, used, frozenset(pool.index[k].namespace for k in by_chunk.get(chunk, ())))
              for used, chunk in slots.chunks_by_use()]
    for chunk in release_order(chunks, quotas or {}):
        if released >= num_chunks:
            break
        in_chunk = set(slots.slots_of(chunk))  # afresh: pages may have moved meanwhile
        keys = [k for k, e in pool.index.items() if e.tier == tier and e.slot in in_chunk]
        if any(pool.is_pinned(k) for k in keys):
            continue
        await pool.demote(keys, tier)
        released += slots.release_empty(num_chunks - released)
    return released


@dataclass(slots=True)
class ElasticMemory:
    """The node's three tier budgets, the quotas, and the arbiter between pools."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int
    chunk_bytes: int
    model_quotas: dict[str, Quota] = field(default_factory=dict)
    namespace_quotas: dict[str, Quota] = field(default_factory=dict)
    budgets: list[TierBudget] = field(init=False)
    holders: dict[str, ElasticPool] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.budgets = [TierBudget(self.device_bytes), TierBudget(self.host_bytes),
                        TierBudget(self.disk_bytes)]

    def share(self, tier: int, holder: str, slot_bytes: int) -> Share:
        """A pool's claim on a tier: chunks of chunk_bytes, smaller in a small tier (so it
        holds at least MIN_CHUNKS of them), never smaller than one slot."""
        budget = self.budgets[tier]
        chunk_bytes = min(self.chunk_bytes, budget.capacity_bytes // MIN_CHUNKS)
        return Share(budget, holder, max(slot_bytes, chunk_bytes))

    def attach(self, holder: str, pool: ElasticPool) -> None:
        """Link a new pool to the budgets and the quotas."""
        self.holders[holder] = pool
        pool.elastic.reclaim = self.reclaim
        pool.elastic.guard = self.guard
        pool.elastic.room = self.room
        self._apply_cap(holder)

    def set_quotas(self, models: dict[str, Quota], namespaces: dict[str, Quota]) -> None:
        """Quotas by pool holder (a page geometry's name) and by namespace, at run time."""
        self.model_quotas, self.namespace_quotas = dict(models), dict(namespaces)
        for holder in self.holders:
            self._apply_cap(holder)

    def _apply_cap(self, holder: str) -> None:
        maximum = self.model_quotas.get(holder, Quota()).max_bytes
        for budget in self.budgets:
            budget.set_cap(holder, maximum)

    # ---- pools asking for room -------------------------------------------------------------

    async def reclaim(self, pool: ElasticPool, tier: int, num_slots: int) -> None:
        """Free enough chunks elsewhere in `tier` for `num_slots` more slots of `pool`."""
        requester = self._holder_of(pool)
        chunk_bytes = pool.slots(tier).chunk_bytes
        freed_bytes = 0  # taken from others this call, not yet held by the requester
        for _ in range(MAX_RECLAIM_ROUNDS):
            if pool._free_slots(tier) >= num_slots:
                return
            donor = choose_donor(self.holdings(tier), requester, freed_bytes + chunk_bytes)
            if donor is None:
                return
            donor_pool = self.holders[donor]
            if not await release_chunks(donor_pool, tier, 1, self.namespace_quotas):
                return
            freed_bytes += donor_pool.slots(tier).chunk_bytes
            self.counters[f"reclaimed_{TIER_NAMES[tier]}"] += 1

    def room(self, tier: int, namespace: str) -> int | None:
        """Bytes `namespace` may still add to `tier` under its max (None: no max)."""
        maximum = self.namespace_quotas.get(namespace, Quota()).max_bytes
        if maximum is None:
            return None
        return max(0, maximum - self.namespace_bytes(tier).get(namespace, 0))

    def guard(self, tier: int, namespace: str, page_bytes: int) -> tuple[frozenset[str], ...]:
        """The namespaces whose pages `namespace` may evict in `tier`, in rounds."""
        usage = self.namespace_bytes(tier)
        guard = namespace_guard(usage, self.namespace_quotas, namespace, page_bytes)
        return giving_order(guard, usage, self.namespace_quotas)

    # ---- idle pools shrinking --------------------------------------------------------------

    async def shrink_idle(self, now_s: float, idle_s: float) -> int:
        """Pools untouched for `idle_s` give their memory chunks back, down to their min;
        returns the chunks released."""
        released = 0
        for holder, pool in self.holders.items():
            if now_s - pool.last_access_s < idle_s:
                continue
            floor = self.model_quotas.get(holder, Quota()).min_bytes
            for tier in (DEVICE, HOST):
                slots = pool.slots(tier)
                extra = (slots.held_bytes - floor) // max(1, slots.chunk_bytes)
                if extra > 0:
                    released += await release_chunks(pool, tier, extra,
                                                     self.namespace_quotas)
        self.counters["idle_released_chunks"] += released
        return released

    # ---- snapshots ---------------------------------------------------------------------------

    def holdings(self, tier: int) -> list[Holding]:
        out = []
        for holder, pool in self.holders.items():
            slots = pool.slots(tier)
            if slots is None:
                continue
            pinned_chunks = {e.slot // slots.slots_per_chunk for k, e in pool.index.items()
                             if e.tier == tier and pool.is_pinned(k)}
            releasable = any(chunk not in pinned_chunks for _, chunk in slots.chunks_by_use())
            out.append(Holding(holder, slots.held_bytes, self.model_quotas.get(holder, Quota()),
                               slots.chunk_bytes, releasable))
        return out

    def namespace_bytes(self, tier: int) -> dict[str, int]:
        usage: Counter = Counter()
        for pool in self.holders.values():
            slot_bytes = pool.disk.slot_bytes if tier == DISK and pool.disk else \
                pool.geometry.slot_bytes
            for (page_tier, namespace), pages in pool.ns_pages.items():
                if page_tier == tier and pages:
                    usage[namespace] += pages * slot_bytes
        return dict(usage)

    def stats(self) -> dict:
        """Per tier: capacity, what each model (pool) holds, what each namespace uses."""
        tiers = {}
        for tier, budget in enumerate(self.budgets):
            tiers[TIER_NAMES[tier]] = {
                "capacity_bytes": budget.capacity_bytes, "held_bytes": budget.used_bytes,
                "models": dict(budget.holders), "namespaces": self.namespace_bytes(tier)}
        return {"tiers": tiers, "chunk_bytes": self.chunk_bytes,
                "quotas": {"models": {k: _quota(q) for k, q in self.model_quotas.items()},
                           "namespaces": {k: _quota(q) for k, q in
                                          self.namespace_quotas.items()}},
                **dict(self.counters)}

    def _holder_of(self, pool: ElasticPool) -> str:
        return next(holder for holder, p in self.holders.items() if p is pool)


def _quota(quota: Quota) -> dict:
    return {"min_bytes": quota.min_bytes, "max_bytes": quota.max_bytes, "weight": quota.weight,
            "priority": quota.priority}
