"""One elastic memory per node: every pool (model) draws its tiers from one budget each.

    NodeStore -- ElasticMemory -- TierBudget x 3 (device, host, disk)
                     |  quotas: model -> Quota, namespace -> Quota (policies/quota.py)
    Pool(model A) ---+--- reclaim(pool, tier, num_slots): take chunks from another pool
    Pool(model B) ---+--- guard(tier, namespace, page_bytes): whose pages a namespace evicts,
                                                   lower priority classes first

A pool that needs a slot first uses its held chunks, then grows by a chunk while the budget
has room. In a full tier, choose_donor names another pool to give a chunk back (its emptiest
chunks' pages are demoted, the chunks released), or the pool evicts its own pages. A pool
idle for `idle_shrink_s` gives its memory chunks back down to its min. A chunk whose pages'
going would put a namespace under its min is not given back. A model's or a namespace's max
lowered at run time is given back at once (give_back_over_max), as far as pages in use
allow; a namespace's max in each tier is namespace_max.py's. Mins a tier cannot
hold (past its capacity, alone or summed) are cut to it, in proportion (fitted_mins), and
the shortfall shown in stats. Pure: no Ray.

This module knows a pool only as an `ElasticPool` (the members it uses); cluster/core/pool.py
imports it for the links and the namespace-quota victims, never the other way round.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from cluster.core.geometry import DEVICE, DISK, HOST, TIER_NAMES
from cluster.core.keys import PageKey
from cluster.core.namespace_max import NamespacePool, give_back_namespace, tier_slot_bytes
from cluster.core.tiers.chunks import ChunkedSlots, Share, TierBudget
from policies.quota import (
    Holding,
    Quota,
    breaks_min,
    choose_donor,
    fitted_quotas,
    giving_order,
    namespace_guard,
    past_max,
    release_order,
)

log = logging.getLogger("raykv.elastic")
MAX_RECLAIM_ROUNDS = 64  # chunks one request may take from others
MIN_CHUNKS = 8  # a tier is cut into at least this many chunks, so models can share it
TIERS = (DEVICE, HOST, DISK)
Floor = Callable[[dict[str, int]], bool]  # bytes given per namespace -> one goes under its min


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


class ElasticPool(NamespacePool, Protocol):
    """What the elastic memory uses of a pool (cluster/core/pool.py's Pool), beyond what a
    namespace's max does (namespace_max.py)."""

    elastic: Elastic
    last_access_s: float

    def slots(self, tier: int) -> ChunkedSlots | None: ...

    def _free_slots(self, tier: int) -> int: ...

    def revoke_leased(self, tier: int, count: int) -> int: ...


def guarded_victims(pool: ElasticPool, tier: int, count: int, namespace: str) -> list[PageKey]:
    """The pool policy's victims, skipping what the namespace quotas protect and what is
    pinned; namespaces give in rounds (policies/quota.py's giving_order): lower priority
    classes first, and within a class those most over their share."""
    if pool.elastic.guard is None:
        return pool.policies[tier].victims(count, pool.is_pinned)
    rounds = pool.elastic.guard(tier, namespace, tier_slot_bytes(pool, tier))
    taken: list[PageKey] = []
    for givers in rounds:
        if len(taken) >= count:
            break
        chosen = set(taken)
        taken += pool.policies[tier].victims(
            count - len(taken), lambda k, g=givers, c=chosen: pool.is_pinned(k) or k in c
            or pool.index[k].namespace not in g)
    return taken[:count]


def pages_by_chunk(pool: ElasticPool, tier: int, slots: ChunkedSlots) -> dict[int, list[PageKey]]:
    """The pool's pages (any state) in `tier`, by the chunk that holds them."""
    by_chunk: dict[int, list[PageKey]] = {}
    for key, entry in pool.index.items():
        if entry.tier == tier:
            by_chunk.setdefault(entry.slot // slots.slots_per_chunk, []).append(key)
    return by_chunk


def chunk_givable(pool: ElasticPool, tier: int, keys: list[PageKey], floor: Floor | None) -> bool:
    """Whether a chunk holding `keys` can be given back: none of its pages is in use (pinned,
    moving or being written), and (with a `floor`) their going puts no namespace under its
    min."""
    if any(pool.is_pinned(k) for k in keys):
        return False
    if floor is None or not keys:
        return True
    slot_bytes = tier_slot_bytes(pool, tier)
    giving: Counter[str] = Counter()
    for key in keys:
        giving[pool.index[key].namespace] += slot_bytes
    return not floor(giving)


async def release_chunks(pool: ElasticPool, tier: int, num_chunks: int,
                         quotas: dict[str, Quota] | None = None,
                         floor: Floor | None = None) -> int:
    """Give up to `num_chunks` of the pool's chunks in `tier` back to the budget: those of
    lower priority classes' pages first (per the namespace `quotas`), the emptiest among
    equals; their pages are demoted. A chunk with a page in use is skipped, and so is one
    whose pages' going would put a namespace under its min (`floor`; None: not checked)."""
    slots = pool.slots(tier)
    if slots is None:
        return 0
    if tier != DISK:  # leased, unwritten slots are room to give before any page moves
        pool.revoke_leased(tier, slots.num_used)
    # Bounded: chunks emptied meanwhile (by the demotion ahead, or a revoked lease) are not
    # all given back, or an idle pool would drop below its min.
    released = slots.release_empty(num_chunks)
    by_chunk = pages_by_chunk(pool, tier, slots)
    chunks = [(chunk, used, frozenset(pool.index[k].namespace for k in by_chunk.get(chunk, ())))
              for used, chunk in slots.chunks_by_use()]
    for chunk in release_order(chunks, quotas or {}):
        if released >= num_chunks:
            break
        in_chunk = set(slots.slots_of(chunk))  # afresh: pages may have moved meanwhile
        keys = [k for k, e in pool.index.items() if e.tier == tier and e.slot in in_chunk]
        if not chunk_givable(pool, tier, keys, floor):
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
    # per tier: (model quotas, namespace quotas) with the mins the tier can hold (fitted_mins)
    fitted: list[tuple[dict[str, Quota], dict[str, Quota]]] = field(init=False)
    holders: dict[str, ElasticPool] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    over_max_pending: bool = False  # a max was lowered: give_back_over_max has not run since
    _giving_back: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.budgets = [TierBudget(self.device_bytes), TierBudget(self.host_bytes),
                        TierBudget(self.disk_bytes)]
        self._fit()

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
        """Quotas by pool holder (a page geometry's name) and by namespace, at run time. A
        pool now over its max in a tier takes no more chunks there (its budget's cap), a
        namespace no more pages (room), and both give the excess back when
        give_back_over_max runs (the node's store schedules it)."""
        self.model_quotas, self.namespace_quotas = dict(models), dict(namespaces)
        self._fit()
        for holder in self.holders:
            self._apply_cap(holder)
        self.over_max_pending = self.is_over_max()
        for tier in TIERS:
            short = self.min_shortfall(tier)
            if short["models"] or short["namespaces"]:
                log.warning("the %s tier (%d bytes) cannot hold these mins; they are cut to it, "
                            "in proportion: short by %s", TIER_NAMES[tier],
                            self.budgets[tier].capacity_bytes, short)

    def _apply_cap(self, holder: str) -> None:
        maximum = self.model_quotas.get(holder, Quota()).max_bytes
        for budget in self.budgets:
            budget.set_cap(holder, maximum)

    def _fit(self) -> None:
        self.fitted = [(fitted_quotas(self.model_quotas, budget.capacity_bytes),
                        fitted_quotas(self.namespace_quotas, budget.capacity_bytes))
                       for budget in self.budgets]

    def model_quota(self, tier: int, holder: str) -> Quota:
        """A pool's quota in `tier`, with the min the tier can hold."""
        return self.fitted[tier][0].get(holder, Quota())

    def floor(self, tier: int, usage: dict[str, int] | None = None) -> Floor:
        """Whether giving bytes per namespace in `tier` would put one under its min (fitted);
        `usage`: the namespaces' bytes there, None: read afresh at each call."""
        quotas = self.fitted[tier][1]
        return lambda giving: breaks_min(
            self.namespace_bytes(tier) if usage is None else usage, quotas, giving)

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
            retired_bytes = self.budgets[tier].retired_bytes
            if not await release_chunks(donor_pool, tier, 1, self.fitted[tier][1],
                                        self.floor(tier)):
                return
            freed_bytes += donor_pool.slots(tier).chunk_bytes
            self.counters[f"reclaimed_{TIER_NAMES[tier]}"] += 1
            if self.budgets[tier].retired_bytes > retired_bytes:
                # A client still maps the chunk (a device chunk: tiers/device_chunks.py): it
                # is the requester's once the node frees it. Taking more from others now
                # would give up chunks that this request will not need.
                return

    def room(self, tier: int, namespace: str) -> int | None:
        """Bytes `namespace` may still add to `tier` under its max (None: no max)."""
        maximum = self.namespace_quotas.get(namespace, Quota()).max_bytes
        if maximum is None:
            return None
        return max(0, maximum - self.namespace_bytes(tier).get(namespace, 0))

    def guard(self, tier: int, namespace: str, page_bytes: int) -> tuple[frozenset[str], ...]:
        """The namespaces whose pages `namespace` may evict in `tier`, in rounds."""
        usage = self.namespace_bytes(tier)
        quotas = self.fitted[tier][1]
        guard = namespace_guard(usage, quotas, namespace, page_bytes)
        return giving_order(guard, usage, quotas)

    # ---- pools giving memory back ----------------------------------------------------------

    async def shrink_idle(self, now_s: float, idle_s: float) -> int:
        """Pools untouched for `idle_s` give their memory chunks back, down to their min (and
        keeping the namespaces' mins); returns the chunks released."""
        released = 0
        for holder, pool in self.holders.items():
            if now_s - pool.last_access_s < idle_s:
                continue
            for tier in (DEVICE, HOST):
                slots = pool.slots(tier)
                floor_bytes = self.model_quota(tier, holder).min_bytes
                extra = (slots.held_bytes - floor_bytes) // max(1, slots.chunk_bytes)
                if extra > 0:
                    released += await release_chunks(pool, tier, extra, self.fitted[tier][1],
                                                     self.floor(tier))
        self.counters["idle_released_chunks"] += released
        return released

    def over_max(self) -> list[tuple[str, int, int]]:
        """(holder, tier, bytes) each pool holds past its max in a tier (a max lowered while
        it held more)."""
        return [(holder, tier, excess_bytes) for tier in TIERS
                for holder, excess_bytes in past_max(self.budgets[tier].holders,
                                                     self.model_quotas).items()
                if holder in self.holders]

    def namespaces_over_max(self) -> list[tuple[str, int, int]]:
        """(namespace, tier, bytes) each namespace holds past its max in a tier (a max
        lowered while it held more), the last tier first: the order they give back in."""
        return [(namespace, tier, excess_bytes) for tier in reversed(TIERS)
                for namespace, excess_bytes in past_max(self.namespace_bytes(tier),
                                                        self.namespace_quotas).items()]

    def is_over_max(self) -> bool:
        """Whether a pool or a namespace holds past its max in a tier."""
        return bool(self.over_max() or self.namespaces_over_max())

    async def give_back_over_max(self) -> int:
        """Pools and namespaces holding more than their max in a tier (it was lowered at run
        time) give the excess back. A pool gives chunks as a donor does (release_chunks:
        lower classes' chunks first, leased slots revoked, pages demoted, or dropped from
        the last tier); the max wins over a namespace's min here. A namespace demotes its
        own least valuable pages there (namespace_max.give_back_namespace), the last tier
        first, so that what goes down makes room under its max below from its coldest
        pages. A page in use (read, pinned, moving or being written) cannot go now: the
        next call (the node's tick) tries again, and meanwhile the pool takes no chunk in
        that tier (TierBudget's cap), the namespace no page (room). Returns the chunks
        given back."""
        async with self._giving_back:
            lowered, self.over_max_pending = self.over_max_pending, False
            released = 0
            for holder, tier, excess_bytes in self.over_max():
                slots = self.holders[holder].slots(tier)
                if slots is None:
                    continue
                num_chunks = -(-excess_bytes // max(1, slots.chunk_bytes))
                released += await release_chunks(self.holders[holder], tier, num_chunks,
                                                 self.fitted[tier][1])
            self.counters["max_released_chunks"] += released
            for namespace, tier, excess_bytes in self.namespaces_over_max():
                self.counters["namespace_max_released_pages"] += await give_back_namespace(
                    list(self.holders.values()), tier, namespace, excess_bytes)
            if lowered:
                self._warn_over_max()
            return released

    def _warn_over_max(self) -> None:
        """What pages in use still hold past a lowered max, once, in the node's log."""
        held_back = ([("model", *over) for over in self.over_max()]
                     + [("namespace", *over) for over in self.namespaces_over_max()])
        for kind, name, tier, excess_bytes in held_back:
            log.warning("%s %s holds %d bytes past its lowered max in the %s tier: pages in "
                        "use; it takes no memory there, and gives them back as they are "
                        "let go", kind, name, excess_bytes, TIER_NAMES[tier])

    # ---- snapshots ---------------------------------------------------------------------------

    def holdings(self, tier: int) -> list[Holding]:
        out = []
        floor = self.floor(tier, self.namespace_bytes(tier))
        for holder, pool in self.holders.items():
            slots = pool.slots(tier)
            if slots is None:
                continue
            by_chunk = pages_by_chunk(pool, tier, slots)
            releasable = any(chunk_givable(pool, tier, by_chunk.get(chunk, []), floor)
                             for _, chunk in slots.chunks_by_use())
            out.append(Holding(holder, slots.held_bytes, self.model_quota(tier, holder),
                               slots.chunk_bytes, releasable))
        return out

    def namespace_bytes(self, tier: int) -> dict[str, int]:
        usage: Counter = Counter()
        for pool in self.holders.values():
            slot_bytes = tier_slot_bytes(pool, tier)
            for (page_tier, namespace), pages in pool.ns_pages.items():
                if page_tier == tier and pages:
                    usage[namespace] += pages * slot_bytes
        return dict(usage)

    def min_shortfall(self, tier: int) -> dict[str, dict[str, int]]:
        """What each model (pool holder) and namespace asked as a min in `tier` past what the
        tier can hold (fitted_mins); nothing for an absent tier."""
        if not self.budgets[tier].capacity_bytes:
            return {"models": {}, "namespaces": {}}
        fitted_models, fitted_namespaces = self.fitted[tier]
        return {"models": _short(self.model_quotas, fitted_models),
                "namespaces": _short(self.namespace_quotas, fitted_namespaces)}

    def stats(self) -> dict:
        """Per tier: capacity, what each model (pool) holds, what each namespace uses, the
        mins the tier cannot hold, and what pools and namespaces hold past a lowered max."""
        tiers = {}
        over: dict[int, dict[str, int]] = {tier: {} for tier in TIERS}
        for holder, tier, excess_bytes in self.over_max():
            over[tier][holder] = excess_bytes
        for tier, budget in enumerate(self.budgets):
            usage = self.namespace_bytes(tier)
            tiers[TIER_NAMES[tier]] = {
                "capacity_bytes": budget.capacity_bytes, "held_bytes": budget.used_bytes,
                "retired_bytes": budget.retired_bytes, "models": dict(budget.holders),
                "namespaces": usage,
                "min_shortfall_bytes": self.min_shortfall(tier), "over_max_bytes": over[tier],
                "namespace_over_max_bytes": past_max(usage, self.namespace_quotas)}
        return {"tiers": tiers, "chunk_bytes": self.chunk_bytes,
                "quotas": {"models": {k: _quota(q) for k, q in self.model_quotas.items()},
                           "namespaces": {k: _quota(q) for k, q in
                                          self.namespace_quotas.items()}},
                **dict(self.counters)}

    def _holder_of(self, pool: ElasticPool) -> str:
        return next(holder for holder, p in self.holders.items() if p is pool)


def _short(registered: dict[str, Quota], fitted: dict[str, Quota]) -> dict[str, int]:
    return {name: quota.min_bytes - fitted[name].min_bytes
            for name, quota in registered.items() if fitted[name].min_bytes < quota.min_bytes}


def _quota(quota: Quota) -> dict:
    return {"min_bytes": quota.min_bytes, "max_bytes": quota.max_bytes, "weight": quota.weight,
            "priority": quota.priority}
