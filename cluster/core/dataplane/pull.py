"""Pull pages from another node's page server straight into this node's host slots.

    on the loop:   reserve host slots for the keys not held here (a reservation, leased),
                   and take their write locks (tiers/fence.py) before any await
    in a thread:   transport.read(keys -> the reserved slots' bytes), then unlock
    on the loop:   keep the leading pages that arrived intact, abort the rest, commit

The transfer's deadline is set inside the reservation's lease, but one receive may block past
it (a connection's wait bound is its own), and a cancelled await leaves the thread running.
So the thread holds the slots' write locks until its last byte has landed: a reservation that
expires meanwhile has its slots quarantined, never reused under the late receive, and its
commit then stores nothing. Replication (the control loop's pull), prefetch and the adoption
of pages a client fetched all come through here.
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
    timeout_s = min(timeout_s, store.config.reserve_lease_s / 2)
    fence, slot_ids = pool.own_writes[HOST], [slot for _, (_, slot) in wanted]
    locked = fence.lock(slot_ids)
    assert locked, "slots reserved a moment ago are locked by another writer"

    def read_then_unlock() -> list[int | None]:
        try:
            return transport.read([read], timeout_s)
        finally:
            fence.unlock(slot_ids)  # only now can no byte of this read land any more

    try:
        (count,) = await asyncio.to_thread(read_then_unlock)
    except BaseException:
        store.abort(reservation_id)
        raise
    store.truncate(reservation_id, [key for key, _ in wanted[count or 0 :]])
    committed = store.commit(reservation_id)  # 0 when the reservation expired meanwhile
    return None if count is None else committed
