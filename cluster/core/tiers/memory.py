"""Memory tiers that same-node clients map directly: host shared memory and device memory.

    slab: | slot 0 | slot 1 | ... | slot n-1 |      each slot = slot_bytes (4096-aligned)

The host tier is a file in /dev/shm mapped by the node actor and by every client on the node,
so a get is one copy from the slab into the caller's tensor, with no hop through Ray.
The device tier is a CUDA allocation when a GPU is visible (clients map it through a CUDA
IPC handle); without one it is a CPU stand-in with the same shared-memory mechanics.
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cluster.core.tiers.slots import SlotAllocator

ALIGN_BYTES = 4096
SHM_DIR = "/dev/shm"


def round_up(value: int, multiple: int = ALIGN_BYTES) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True, slots=True)
class ArenaDescriptor:
    """What a client needs to map an arena: a shm path, or a CUDA IPC handle."""

    tier: str
    slot_bytes: int
    num_slots: int
    shm_path: str | None = None
    cuda_handle: object | None = None


class MappedArena:
    """A slab of fixed-size slots that clients on the node can map."""

    def __init__(self, tier: str, capacity_bytes: int, slot_bytes: int, use_cuda: bool = False,
                 shm_prefix: str = "raykv"):
        assert slot_bytes % ALIGN_BYTES == 0, "slot_bytes must be 4096-aligned"
        self.tier = tier
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.slots = SlotAllocator(self.num_slots)
        self._shm_prefix = shm_prefix
        self._shm_path: str | None = None
        self._mmap: mmap.mmap | None = None
        if use_cuda:
            self.tensor = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8, device="cuda")
        else:
            self.tensor = self._map_shm()

    def _map_shm(self) -> torch.Tensor:
        nbytes = max(self.num_slots * self.slot_bytes, ALIGN_BYTES)
        name = f"{self._shm_prefix}-{self.tier}-{uuid.uuid4().hex[:12]}"
        self._shm_path = os.path.join(SHM_DIR, name)
        fd = os.open(self._shm_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _populate())
        finally:
            os.close(fd)
        _advise_hugepages(self._mmap)
        return torch.frombuffer(self._mmap, dtype=torch.uint8)

    def alloc(self) -> int | None:
        return self.slots.alloc()

    def free(self, slot: int) -> None:
        self.slots.free(slot)

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes as a 1-D uint8 tensor (a view, no copy)."""
        start = slot * self.slot_bytes
        return self.tensor[start : start + self.slot_bytes]

    def descriptor(self) -> ArenaDescriptor:
        handle = None
        if self.tensor.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            handle = reduce_tensor(self.tensor)
        return ArenaDescriptor(self.tier, self.slot_bytes, self.num_slots, self._shm_path, handle)

    @property
    def used_bytes(self) -> int:
        return self.slots.num_used * self.slot_bytes

    def close(self) -> None:
        """Unlink the shm file; mappings already open stay valid until unmapped."""
        if self._shm_path and os.path.exists(self._shm_path):
            os.unlink(self._shm_path)


class ArenaMapping:
    """A client's mapping of a node arena, opened once and reused."""

    def __init__(self, descriptor: ArenaDescriptor):
        self.descriptor = descriptor
        if descriptor.cuda_handle is not None:
            rebuild, args = descriptor.cuda_handle
            self.tensor = rebuild(*args)
            return
        fd = os.open(descriptor.shm_path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _populate())
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def view(self, slot: int) -> torch.Tensor:
        start = slot * self.descriptor.slot_bytes
        return self.tensor[start : start + self.descriptor.slot_bytes]


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
