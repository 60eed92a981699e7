"""A stable home on this host for one node actor's disk slabs and shared memory.

    {disk_root}/node-0.lock  node-0/   <- held (flock) by the first node actor on this host
    {disk_root}/node-1.lock  node-1/   <- a second raylet on the same host (simulated nodes)

Ray node ids change whenever a raylet restarts, so keying the disk by node id would strand its
pages after every restart and leak a slab set per session. A slot is claimed with an exclusive
flock held for the actor's life; the kernel drops it when the process dies, so a restarted
actor (or the next session) claims the same slot, recovers its pages, and reclaims whatever
shared memory the previous holder left behind.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from cluster.core.keys import page_hash
from cluster.core.tiers.aligned import make_private_dir, open_private

MAX_SLOTS_PER_HOST = 256


@dataclass(frozen=True, slots=True)
class NodeSlot:
    index: int
    disk_dir: str
    shm_prefix: str
    lock_fd: int

    def release(self) -> None:
        os.close(self.lock_fd)


def slot_shm_prefix(disk_root: str, index: int | None = None) -> str:
    """The shm name prefix of a slot under `disk_root` (of every slot when index is None)."""
    root_tag = page_hash(os.path.realpath(disk_root).encode()).hex()[:8]
    return f"raykv-{root_tag}" if index is None else f"raykv-{root_tag}-{index}"


def claim_node_slot(disk_root: str) -> NodeSlot:
    """Claim the lowest free slot under `disk_root`; RuntimeError when all are held."""
    make_private_dir(disk_root)
    for index in range(MAX_SLOTS_PER_HOST):
        fd = open_private(os.path.join(disk_root, f"node-{index}.lock"), os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        disk_dir = os.path.join(disk_root, f"node-{index}")
        make_private_dir(disk_dir)
        return NodeSlot(index, disk_dir, slot_shm_prefix(disk_root, index), fd)
    raise RuntimeError(f"all {MAX_SLOTS_PER_HOST} node slots under {disk_root} are held")
