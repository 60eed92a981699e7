"""The soak: a bounded concurrent workload for a few minutes, then the leftovers.

    RSS growth       of each node actor's process and of this (the client's) process, from
                     the end of a warm-up (the tiers full, every buffer pool grown) to the end
    leases, reservations   every node's count once the workload stopped (back to 0)
    files left       /dev/shm segments of the service after a plain stop(); and after a
                     purge(), every file under the disk root and every segment

Used by `raykv bench faults` (2 minutes) and tests/cluster/test_soak.py.
"""

from __future__ import annotations

import os
import time

import psutil
import ray

from actors.handles import NodeHandle
from cluster.core.config import CacheConfig
from cluster.core.membership import kv_nodes
from cluster.core.tiers.node_slot import slot_shm_prefix
from cluster.tools.bench.faults_workload import Workload, tally
from cluster.tools.slab_faults import files_under, shm_segments

SETTLE_S = 10.0


def node_handles(config: CacheConfig) -> list[NodeHandle]:
    """The node actors of the cluster's kv nodes that are running now."""
    handles = [NodeHandle.lookup(n, config) for n in kv_nodes(config.node_resource, ray.nodes())]
    return [h for h in handles if h is not None]


def node_stats(config: CacheConfig) -> list[dict]:
    return ray.get([h.stats() for h in node_handles(config)], timeout=60)


def rss_bytes(pids: list[int]) -> dict[int, int]:
    return {pid: psutil.Process(pid).memory_info().rss for pid in pids}


def run_soak(spec, config: CacheConfig, duration_s: float, num_threads: int = 2) -> dict:
    """The workload for `duration_s` (the first quarter, at most 30 s, is the warm-up); the
    tally of every operation, RSS growth per process, and the leases and reservations left
    once it stopped."""
    warmup_s = min(30.0, duration_s / 4)
    work = Workload(spec, num_threads, max_ops=10**7)
    work.start([])
    time.sleep(warmup_s)
    pids = [s["pid"] for s in node_stats(config)] + [os.getpid()]
    before = rss_bytes(pids)
    time.sleep(duration_s - warmup_s)
    after = rss_bytes(pids)
    work.stop()
    growth = {pid: (after[pid] - before[pid]) / before[pid] for pid in pids}
    left = _wait_quiet(config)
    return {"duration_s": duration_s, "warmup_s": warmup_s, **tally(work.records),
            "rss_before_bytes": before, "rss_after_bytes": after,
            "rss_growth": max(growth.values()), "rss_growth_by_pid": growth, **left}


def _wait_quiet(config: CacheConfig) -> dict:
    """Leases and reservations over every node, polled until both are 0 (or SETTLE_S)."""
    deadline_s = time.monotonic() + SETTLE_S
    while True:
        stats = node_stats(config)
        left = {"leases": sum(s["leases"] for s in stats),
                "reservations": sum(s["reservations"] for s in stats)}
        if not any(left.values()) or time.monotonic() > deadline_s:
            return left
        time.sleep(0.2)


def leftovers_after_stop(config: CacheConfig) -> dict:
    """Stop (shared memory must go), start again (the disk pages are recovered), stop with
    purge (the slab files must go too); what is left after each."""
    from cluster import purge, start
    from cluster.tools.bench.common import stop_service

    prefix = slot_shm_prefix(config.disk_dir)
    stop_service()
    shm_after_stop = shm_segments(prefix)
    slab_files_kept = [f for f in files_under(config.disk_dir) if "slab-" in f]
    start(config)
    recovered = sum(s.get("recovered_pages", 0) for s in _ready(config))
    stop_service(purge)
    files_after_purge = files_under(config.disk_dir)
    shm_after_purge = shm_segments(prefix)
    return {"shm_after_stop": shm_after_stop, "slab_files_kept_by_stop": len(slab_files_kept),
            "recovered_pages_on_restart": recovered, "files_after_purge": files_after_purge,
            "shm_after_purge": shm_after_purge,
            "files_left": len(shm_after_stop) + len(files_after_purge) + len(shm_after_purge)}


def _ready(config: CacheConfig) -> list[dict]:
    return ray.get([h.ready() for h in node_handles(config)], timeout=120)
