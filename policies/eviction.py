"""Eviction policies: which page of a tier to demote next.

Pure Python (no ray, torch or numpy). A policy only orders keys; the tier moves the bytes.

The node store drives one policy per tier:

    insert page   -> on_insert(key, parent)  # parent: the put's previous new page, or None
    hit           -> on_access(key)
    need room     -> victims(n, is_pinned)   # suggestions; nothing is removed
    page leaves   -> on_remove(key)          # evicted, promoted, deleted: any reason

    a run of pages -> on_insert_many(keys, parent, chained), on_remove_many(keys): the same
                      as a call per key in order (PerKeyBatches); recfreq and putdepth run
                      them in one loop

Keys are any hashable (page keys are 16-byte ``bytes``). Unknown keys are harmless in
``on_access`` and ``on_remove``. ``parent`` is optional: the page inserted just before by the
same put, its parent in the chain (Pool.commit passes the put's new pages in chain order),
and None for a put's first page or when unknown (a demotion, an adopted disk page). Only
``putdepth`` reads it.
"""

from __future__ import annotations

# The policies live one family a module (eviction_lru, eviction_s3fifo, eviction_recfreq,
# eviction_putdepth) on a shared base (eviction_base); their names are importable from here.
from policies.eviction_base import EvictionPolicy, IsPinned, Key, PerKeyBatches
from policies.eviction_lru import LRUPolicy
from policies.eviction_putdepth import (
    PUT_DEPTH_DISCOUNT,
    PUT_DEPTH_HORIZON_FACTOR,
    PutDepthPolicy,
)
from policies.eviction_recfreq import (
    GHOST_FACTOR,
    HORIZON_FACTOR,
    MAX_USES,
    MEDIAN_STEP,
    Entry,
    RecencyFrequencyPolicy,
)
from policies.eviction_s3fifo import MAX_FREQ, SMALL_FRACTION, S3FIFOPolicy

__all__ = [
    "EVICTION_POLICIES", "GHOST_FACTOR", "HORIZON_FACTOR", "MAX_FREQ", "MAX_USES", "MEDIAN_STEP",
    "PUT_DEPTH_DISCOUNT", "PUT_DEPTH_HORIZON_FACTOR", "SMALL_FRACTION", "Entry", "EvictionPolicy",
    "IsPinned", "Key", "LRUPolicy", "PerKeyBatches", "PutDepthPolicy", "RecencyFrequencyPolicy",
    "S3FIFOPolicy", "make_policy",
]

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "recfreq": RecencyFrequencyPolicy,
    "putdepth": PutDepthPolicy,
}


def make_policy(name: str, capacity_pages: int) -> EvictionPolicy:
    """A fresh policy from the registry; ValueError naming the known ones if unknown."""
    cls = EVICTION_POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; known policies: {known}")
    return cls(capacity_pages)
