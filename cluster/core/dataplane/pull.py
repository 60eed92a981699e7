"""Pull pages from another node's page server straight into this node's host slots.

    on the loop:   reserve host slots for the keys not held here (a reservation, leased)
    in a thread:   transport.read(keys -> the reserved slots' bytes)
    on the loop:   keep the leading pages that arrived intact, abort the rest, commit

The transfer's deadline is well inside the reservation's lease, so the slots written are
still ours. Replication (the control loop's pull), prefetch and the adoption of pages a
client fetched all come through here.
"""

from __future__ import annotations

import asyncio

from cluster.core.dataplane.auth import Authority
from cluster.core.dataplane.endpoint import Endpoint, PageRead
from cluster.core.dataplane.transport import Transport
from cluster.core.geometry import HOST, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.store import NodeStore


async def pull_pages(store: NodeStore, transport: Transport, endpoint: Endpoint,
                     request: tuple[PageGeometry, list[PageKey], str, Authority],
                     timeout_s: float) -> int | None:
    """Pages now held here that came over the wire; None when the owner could not be read.

    `request` is (geometry, keys, namespace the pages are kept under, the authority the
    owner is asked with: the node's).
    """
    geometry, keys, namespace, authority = request
    reservation_id, slots = await store.reserve(geometry, keys, HOST, namespace)
    wanted = [(key, slot) for key, slot in zip(keys, slots, strict=False) if slot is not None]
    if not wanted:
        return 0
    pool = store.pools[geometry]
    dests = tuple((memoryview(pool.memory[tier].view(slot)[: geometry.page_bytes].numpy()),)
                  for _, (tier, slot) in wanted)
    read = PageRead(endpoint, geometry, tuple(key for key, _ in wanted), dests, authority)
    timeout_s = min(timeout_s, store.config.reserve_lease_s / 2)  # the slots stay ours
    try:
        (count,) = await asyncio.to_thread(transport.read, [read], timeout_s)
    except BaseException:
        store.abort(reservation_id)
        raise
    store.truncate(reservation_id, [key for key, _ in wanted[count or 0 :]])
    store.commit(reservation_id)
    return count
