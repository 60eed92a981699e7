"""Memory chunks readied ahead of need, off the node's event loop (NodeStore.grow_ahead)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from cluster.core.background import background_thread
from cluster.core.geometry import PageGeometry
from cluster.core.pool import Pool
from cluster.core.put_leases import PutLeases


async def grow_ahead(pool: Pool, geometry: PageGeometry, put_leases: PutLeases) -> int:
    """Ready memory chunks, ahead of need, for each tier of the geometry's pool that is
    short of free slots (fewer than a chunk's worth, or than the latest lease top-up
    asked for), from free budget only: their memory is faulted in off the event loop, in
    a thread of lower CPU priority (cluster/core/background.py: it yields to the copies
    of the puts under way), so the next put into fresh slots, and the next lease top-up,
    find them ready. A pool that puts thus holds up to a chunk (or a top-up's worth) more
    than its pages, which other pools can reclaim (it is empty) and which an idle pool
    gives back. Returns how many chunks were readied."""
    grown = 0
    for tier, arena in enumerate(pool.memory):
        # as many free slots as the latest lease top-up asked for, so that the next (which
        # takes held slots only: put_leases.py) finds them ready
        ahead = put_leases.wanted(geometry, tier)
        while (chunk := arena.slots.take_ahead(ahead)) is not None:
            if not await arena.ready_taken(chunk, _ready_thread()):
                break  # none to give: this tier grows no further
            grown += 1
    return grown


def _ready_thread() -> ThreadPoolExecutor:
    """The thread that readies memory chunks ahead of need (one per process)."""
    return background_thread("raykv-ready")
