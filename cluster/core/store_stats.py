"""What a NodeStore reports (NodeStore.stats, and through it the node actor's stats and
metrics): pages and bytes by tier, memory by model, evictions, leases, the disk's and the
checksums' counters, pins."""

from __future__ import annotations

from cluster.core.elastic import ElasticMemory
from cluster.core.geometry import TIER_NAMES


def store_stats(store) -> dict:
    """Every counter of a NodeStore, summed over its pools (the store is not imported here:
    cluster/core/store.py imports this module)."""
    pages = {name: 0 for name in TIER_NAMES}
    used_bytes = {name: 0 for name in TIER_NAMES}
    for pool in store.pools.values():
        for name, count in pool.tier_counts().items():
            pages[name] += count
            used_bytes[name] += count * pool.geometry.page_bytes
    disks = [pool.disk for pool in store.pools.values() if pool.disk is not None]
    arenas = [arena for pool in store.pools.values() for arena in pool.memory]
    evictions = {name: sum(p.evictions[tier] for p in store.pools.values())
                 for tier, name in enumerate(TIER_NAMES)}
    tax_us = max((p.disk_read_us_per_token for p in store.pools.values()), default=0.0)
    return {"pages": pages, "bytes": used_bytes, "leases": len(store.leases),
            "memory": store.elastic.stats(), "models": store.memory_by_model(),
            "evictions": evictions, "disk_read_us_per_token": tax_us,
            "disk_read_s": sum(p.disk_read_s for p in store.pools.values()),
            "reservations": len(store.reservations),
            "leased_slots": store.put_leases.num_leased(),
            **store.put_leases.counters,
            "quarantined_slots": sum(len(p.quarantined) for p in store.pools.values()),
            "host_headroom_pages": sum(p.headroom_pages() for p in store.pools.values()),
            "host_headroom_short_pages": sum(p.headroom_short() for p in store.pools.values()),
            "demoted_ahead_pages": sum(p.demoted_ahead for p in store.pools.values()),
            "checksums_ahead_pages": sum(p.checksums_ahead for p in store.pools.values()),
            "inline_checksum_pages": sum(p.inline_checksums for p in store.pools.values()),
            "checksum_queued_pages": sum(p.num_unsummed for p in store.pools.values()),
            # memory faulted in while a put (or a read-up) waited, not ahead of it
            "ready_on_path_chunks": sum(a.ready_on_path_chunks for a in arenas),
            # chunks whose memory the machine could not give (taken as no room: chunks.py)
            "chunk_grant_failures": sum(a.slots.grant_failures for a in [*arenas, *disks]),
            "ready_on_path_s": sum(a.ready_on_path_s for a in arenas),
            # device chunks given back but still mapped by a client: taken, not free yet
            "retired_chunk_bytes": sum(a.retired_bytes for a in arenas),
            "disk_bytes_read": sum(d.bytes_read for d in disks),
            "disk_bytes_written": sum(d.bytes_written for d in disks),
            "disk_checksum_failures": sum(d.checksum_failures for d in disks),
            "pins": {**store.pins.stats(), "cap_bytes": store.pin_cap_bytes()},
            **store.counters}


def memory_by_model(elastic: ElasticMemory, model_names: dict[str, str]) -> dict[str, int]:
    """Bytes each model holds across the tiers: a pool holder (a geometry's name) counts for
    the model `model_names` names it by, else under its own name."""
    held: dict[str, int] = {}
    for budget in elastic.budgets:
        for holder, num_bytes in budget.holders.items():
            name = model_names.get(holder, holder)
            held[name] = held.get(name, 0) + num_bytes
    return held
