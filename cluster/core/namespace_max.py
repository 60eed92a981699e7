"""A namespace's max in each tier of a node: what a page moving into a tier may take there,
and what a lowered max gives back. Pure: no Ray.

    put / leased commit  ---> within_namespace_max(tier)      its own coldest pages there
    demotion (down)      ---> admitted_into(tier below)       demoted first, to make room;
    read-up, promotion   ---> admitted_into(tier above)       what no own page makes room
                                                              for stays where it is
    max lowered          ---> give_back_namespace(tier)       own coldest pages demoted

The namespace's own least valuable pages in the tier (any model's pool, never pinned, moving
or being written) are the only ones moved for its max: other namespaces' pages never are.
The max is per tier: a namespace may hold up to it in each (elastic.ElasticMemory.room).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Protocol

from cluster.core.geometry import DISK, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.pool_entry import Entry
from cluster.core.tiers.disk import DiskArena
from policies.eviction import EvictionPolicy


class RoomLink(Protocol):
    """`room(tier, namespace)`: the bytes a namespace may still add under its max (None: no
    max); None itself for a pool on its own (elastic.Elastic)."""

    room: Callable[[int, str], int | None] | None


class NamespacePool(Protocol):
    """What this module uses of a pool (cluster/core/pool.py's Pool)."""

    elastic: RoomLink
    geometry: PageGeometry
    index: dict[PageKey, Entry]
    policies: list[EvictionPolicy]  # one per tier
    ns_pages: Counter[tuple[int, str]]  # (tier, namespace) -> pages
    disk: DiskArena | None

    def is_pinned(self, key: PageKey) -> bool: ...

    async def demote(self, keys: list[PageKey], tier: int,
                     keep_unmoved: bool = False) -> list[PageKey]: ...


def tier_slot_bytes(pool: NamespacePool, tier: int) -> int:
    """What one page takes in `tier`: a disk slot is the page and its header, aligned."""
    if tier == DISK and pool.disk is not None:
        return pool.disk.slot_bytes
    return pool.geometry.slot_bytes


def namespace_room_pages(pool: NamespacePool, tier: int, namespace: str) -> int | None:
    """How many more pages `namespace` may place in `tier` under its max, demoting nothing
    (None: no max)."""
    if pool.elastic.room is None:
        return None
    room_bytes = pool.elastic.room(tier, namespace)
    return None if room_bytes is None else room_bytes // tier_slot_bytes(pool, tier)


async def demote_own(pool: NamespacePool, tier: int, namespace: str, count: int,
                     keep_unmoved: bool = False) -> int:
    """Demote up to `count` of `namespace`'s least valuable pages in `tier` (none pinned,
    moving or being written; `keep_unmoved`: see Pool.demote); returns how many were
    chosen."""
    if count <= 0:
        return 0
    own = pool.policies[tier].victims(
        count, lambda k: pool.is_pinned(k) or pool.index[k].namespace != namespace)
    if own:
        await pool.demote(own, tier, keep_unmoved)
    return len(own)


async def within_namespace_max(pool: NamespacePool, tier: int, namespace: str, count: int,
                               keep_unmoved: bool = False) -> int:
    """How many of `count` new pages `namespace` may place in `tier` under its max: its own
    least valuable pages there are demoted to make the room (`keep_unmoved`: see
    Pool.demote). (Pages of other namespaces are never evicted for this.)"""
    room = namespace_room_pages(pool, tier, namespace)
    if room is None:
        return count
    if count > room:
        await demote_own(pool, tier, namespace, count - room, keep_unmoved)
        room = namespace_room_pages(pool, tier, namespace) or 0
    return max(0, min(count, room))


async def admitted_into(pool: NamespacePool, tier: int, keys: list[PageKey],
                        keep_unmoved: bool) -> tuple[list[PageKey], list[PageKey]]:
    """Of pages moving into `tier` (demoted into it, read up or promoted into it), (those
    their namespaces' max there admits, the rest), each list in the order of `keys`: a
    namespace at its max first demotes its own least valuable pages of `tier` to make the
    room, as its puts do (within_namespace_max)."""
    by_namespace: dict[str, list[PageKey]] = {}
    for key in keys:
        by_namespace.setdefault(pool.index[key].namespace, []).append(key)
    admitted: set[PageKey] = set()
    for namespace, group in by_namespace.items():
        count = await within_namespace_max(pool, tier, namespace, len(group), keep_unmoved)
        admitted.update(group[:count])
    return ([key for key in keys if key in admitted],
            [key for key in keys if key not in admitted])


async def give_back_namespace(pools: list[NamespacePool], tier: int, namespace: str,
                              excess_bytes: int) -> int:
    """`namespace` holds `excess_bytes` past its (lowered) max in `tier`: its least valuable
    pages there are demoted (dropped from the last tier) until it holds no more than the
    max: each pool (model) gives in proportion to what the namespace holds in it, in whole
    pages, then the pools in turn give what rounding left. A page in use stays, for a later
    call. Returns the pages chosen."""
    held = [(pool, pool.ns_pages[(tier, namespace)] * tier_slot_bytes(pool, tier))
            for pool in pools]
    total_bytes = sum(held_bytes for _, held_bytes in held)
    if total_bytes <= 0:
        return 0
    left_bytes, chosen = excess_bytes, 0
    for pool, held_bytes in held:
        slot_bytes = tier_slot_bytes(pool, tier)
        count = await demote_own(pool, tier, namespace,
                                 excess_bytes * held_bytes // (total_bytes * slot_bytes))
        left_bytes, chosen = left_bytes - count * slot_bytes, chosen + count
    for pool, _ in held:
        if left_bytes <= 0:
            break
        slot_bytes = tier_slot_bytes(pool, tier)
        count = await demote_own(pool, tier, namespace, -(-left_bytes // slot_bytes))
        left_bytes, chosen = left_bytes - count * slot_bytes, chosen + count
    return chosen
