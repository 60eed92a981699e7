"""Memory tiers that same-node clients map directly: host shared memory and device memory.

    slab:        | slot 0 | slot 1 | ... | slot n-1 |      each slot = slot_bytes (4096-aligned)
    generations: | g0 | g1 | ... | g(n-1) |               uint64, shared memory, one per slot

The host tier is a file in /dev/shm mapped by the node actor and by every client on the node,
so a get is one copy from the slab into the caller's tensor, with no hop through Ray.
The device tier is a CUDA allocation when a GPU is visible (clients map it through a CUDA
IPC handle); without one it is a CPU stand-in with the same shared-memory mechanics.

A slot's generation grows each time the slot is freed. A reader notes it when the node pins
the page for it and checks it again after its copy: a changed generation means the slot was
freed (its lease ran out) and perhaps reused while the copy ran, so the copy is a miss.
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cluster.core.tiers.aligned import ALIGN_BYTES, round_up
from cluster.core.tiers.slots import SlotAllocator

SHM_DIR = os.environ.get("RAYKV_SHM_DIR", "/dev/shm")
GEN_BYTES = 8


class SharedMemoryTooSmall(RuntimeError):
    """/dev/shm cannot hold the slabs the configuration asks for."""


@dataclass(frozen=True, slots=True)
class ArenaDescriptor:
    """What a client needs to map an arena: a shm path or a CUDA IPC handle, and the
    generation table's shm path."""

    tier: str
    slot_bytes: int
    num_slots: int
    shm_path: str | None = None
    cuda_handle: object | None = None
    generations_path: str | None = None


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    stats = os.statvfs(shm_dir)
    return stats.f_bavail * stats.f_frsize


def check_shm_room(needed_bytes: int, shm_dir: str = SHM_DIR) -> None:
    """Raise SharedMemoryTooSmall, naming the sizes and the fix, when `shm_dir` lacks room.

    Slabs are mapped with MAP_POPULATE: on a tmpfs too small for them the shortfall would
    surface later as a SIGBUS in whichever process touches the missing page first.
    """
    free_bytes = shm_free_bytes(shm_dir)
    if needed_bytes > free_bytes:
        raise SharedMemoryTooSmall(
            f"{shm_dir} has {free_bytes / 2**20:.0f} MiB free but raykv's memory tiers need "
            f"{needed_bytes / 2**20:.0f} MiB ({needed_bytes} bytes) on this node. Give the "
            f"container more shared memory (docker run --shm-size={_gib_ceil(needed_bytes)}g; "
            "in Kubernetes mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm), "
            "or lower CacheConfig.host_bytes / device_bytes.")


def _gib_ceil(num_bytes: int) -> int:
    return -(-int(num_bytes * 1.1) // 2**30)


class _SharedFile:
    """A file in shared memory, mapped read-write; unlinked by close()."""

    def __init__(self, name: str, nbytes: int):
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _populate())
        finally:
            os.close(fd)

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _map_file(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _populate())
    finally:
        os.close(fd)


class MappedArena:
    """A slab of fixed-size slots that clients on the node can map."""

    def __init__(self, tier: str, capacity_bytes: int, slot_bytes: int, use_cuda: bool = False,
                 shm_prefix: str = "raykv"):
        assert slot_bytes % ALIGN_BYTES == 0, "slot_bytes must be 4096-aligned"
        self.tier = tier
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.slots = SlotAllocator(self.num_slots)
        tag = f"{shm_prefix}-{tier}-{uuid.uuid4().hex[:12]}"
        self._slab: _SharedFile | None = None
        if use_cuda:
            self.tensor = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8, device="cuda")
        else:
            self._slab = _SharedFile(tag, max(self.num_slots * slot_bytes, ALIGN_BYTES))
            _advise_hugepages(self._slab.mmap)
            self.tensor = torch.frombuffer(self._slab.mmap, dtype=torch.uint8)
        self._generations_file = _SharedFile(tag + "-gen",
                                             round_up(max(1, self.num_slots) * GEN_BYTES))
        self.generations = np.frombuffer(self._generations_file.mmap, dtype=np.uint64)

    def alloc(self) -> int | None:
        return self.slots.alloc()

    def free(self, slot: int) -> None:
        self.slots.free(slot)
        self.generations[slot] += 1  # a reader still copying from it will notice

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes as a 1-D uint8 tensor (a view, no copy)."""
        start = slot * self.slot_bytes
        return self.tensor[start : start + self.slot_bytes]

    def generation(self, slot: int) -> int:
        return int(self.generations[slot])

    def descriptor(self) -> ArenaDescriptor:
        handle = None
        if self.tensor.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            handle = reduce_tensor(self.tensor)
        shm_path = self._slab.path if self._slab is not None else None
        return ArenaDescriptor(self.tier, self.slot_bytes, self.num_slots, shm_path, handle,
                               self._generations_file.path)

    @property
    def used_bytes(self) -> int:
        return self.slots.num_used * self.slot_bytes

    def close(self) -> None:
        """Unlink the shm files; mappings already open stay valid until unmapped."""
        if self._slab is not None:
            self._slab.close()
        self._generations_file.close()


class ArenaMapping:
    """A client's mapping of a node arena, opened once and reused."""

    def __init__(self, descriptor: ArenaDescriptor):
        self.descriptor = descriptor
        self.generations = np.frombuffer(_map_file(descriptor.generations_path), dtype=np.uint64)
        if descriptor.cuda_handle is not None:
            rebuild, args = descriptor.cuda_handle
            self.tensor = rebuild(*args)
            return
        self.tensor = torch.frombuffer(_map_file(descriptor.shm_path), dtype=torch.uint8)

    def view(self, slot: int) -> torch.Tensor:
        start = slot * self.descriptor.slot_bytes
        return self.tensor[start : start + self.descriptor.slot_bytes]

    def generation(self, slot: int) -> int:
        return int(self.generations[slot])


def _populate() -> int:
    # Pre-fault the mapping: a fresh page costs a fault on first touch, which halves copy speed.
    return getattr(mmap, "MAP_POPULATE", 0)


def _advise_hugepages(mapping: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        mapping.madvise(advice)
    except OSError:  # the kernel refuses THP for shmem here; plain pages still work
        pass


def cuda_available() -> bool:
    return torch.cuda.is_available()


def remove_stale_shm(shm_prefix: str) -> int:
    """Unlink slabs left by an earlier incarnation of a node actor (killed without cleanup)."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(shm_prefix + "-"):
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
    return removed


def readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only array (Ray hands those back) for reading, without a copy."""
    with warnings.catch_warnings():  # torch warns that writes would be undefined; we only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
