"""Memory tiers that same-node clients map directly: host shared memory and device memory.

    slab:        | chunk 0          | chunk 1 (not held) | chunk 2          | ...
                 | slot 0 | slot 1  |                    | slot 4 | slot 5  |   4096-aligned
    generations: | g0 | g1 | g2 | ... |                                uint64, one per slot

An arena spans its pool's whole possible capacity, but holds memory only for the chunks its
pool was granted from the tier's node-wide budget (chunks.py). That is how models share one
budget elastically.

The host tier is one sparse file in /dev/shm mapped by the node actor and by every client on
the node (a granted chunk is populated, a released one punched out), so a get is one copy from
the slab into the caller's tensor, with no hop through Ray. The device tier is one separate
allocation per chunk (device_chunks.py): VRAM with a CUDA IPC handle where a GPU is visible,
else a shared-memory file per chunk, its CPU stand-in. A chunk granted again is a new
allocation, so clients remap when the arena's layout version changes. A released device chunk
is retired until no client maps it (chunk_readers.py); its bytes stay taken from the tier's
budget until reap_retired frees it.

A slot's generation grows each time the slot is freed. A reader notes it when the node pins
the page for it and checks it again after its copy: a changed generation means the slot was
freed (its lease ran out) and perhaps reused while the copy ran, so the copy is a miss.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from cluster.core.tiers.aligned import ALIGN_BYTES, round_up
from cluster.core.tiers.chunk_readers import RETIRED_CHUNK_MAX_S
from cluster.core.tiers.chunks import NO_MEMORY, ChunkedSlots, Share
from cluster.core.tiers.device_chunks import CudaChunks, DeviceLayout, DeviceMaps, ShmChunks
from cluster.core.tiers.shm import SHM_DIR, SharedFile, map_file, populate_range

GEN_BYTES = 8


class SharedMemoryTooSmall(RuntimeError):
    """/dev/shm cannot hold the slabs the configuration asks for."""


@dataclass(frozen=True, slots=True)
class ArenaDescriptor:
    """What a client needs to map an arena: a shm path (host) or the layout of its chunks
    (device), and the generation table's shm path."""

    tier: str
    slot_bytes: int
    num_slots: int
    shm_path: str | None = None
    device_layout: DeviceLayout | None = None
    generations_path: str | None = None
    chunk_bytes: int = 0
    held_path: str | None = None  # the pool's held-pages index (held_index.py), if any
    disk_held_path: str | None = None  # its disk pages' index, if it has a disk tier
    disk_dir: str | None = None  # ... and where their slab files are (disk_reader.py)
    disk_threads: int = 0  # ... and how many reads the node keeps in flight on them

    @property
    def layout_version(self) -> int:
        return self.device_layout.version if self.device_layout is not None else 0


@dataclass(frozen=True, slots=True)
class SlabStamp:
    """Which slabs the slots of a node's reply refer to: the node actor's epoch (a restarted
    actor has new slabs) and its pool's layout version (grows as device chunks, each a new
    allocation, come and go). Every reserve, acquire and descriptors reply carries one."""

    epoch: int
    layout_version: int = 0

    def covered_by(self, epoch: int | None, layout_version: int) -> bool:
        """Whether mappings of `epoch` at `layout_version` reach every slot of the reply."""
        return epoch == self.epoch and layout_version >= self.layout_version


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


def _advise(mapping: mmap.mmap, advice: int, start: int, length: int) -> bool:
    try:
        mapping.madvise(advice, start, length)
        return True
    except (OSError, ValueError):
        return False


class _ShmSlab:
    """The CPU backing of an arena: one sparse shared-memory file over the whole capacity.
    A granted chunk is populated (faulted in) at once; a released one is punched out, so
    the memory goes back to the machine while the file keeps its size."""

    def __init__(self, name: str, nbytes: int):
        self.file = SharedFile(name, max(nbytes, ALIGN_BYTES), populate=False)
        _advise_hugepages(self.file.mmap)
        self.tensor = torch.frombuffer(self.file.mmap, dtype=torch.uint8)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def grant(self, offset: int, nbytes: int) -> None:
        if not populate_range(self.tensor.data_ptr() + offset, nbytes):
            self.tensor[offset : offset + nbytes].zero_()  # older kernels: touch it

    def release(self, offset: int, nbytes: int) -> None:
        _advise(self.file.mmap, mmap.MADV_REMOVE, offset, nbytes)

    def descriptor_fields(self) -> dict:
        return {"shm_path": self.file.path}

    version = 0  # one file for good: a client's mapping never goes stale
    retired_bytes = 0  # a released chunk is punched out at once: mappings stay valid

    def reap_retired(self, now_s: float | None = None) -> int:
        return 0

    def close(self) -> None:
        self.file.close()


def _backing(tier: str, slots: ChunkedSlots, capacity_bytes: int, tag: str,
             options: ArenaOptions):
    """The device tier: one allocation per chunk (VRAM, or its CPU stand-in); the host tier:
    one sparse shared-memory file."""
    if tier != "device":
        return _ShmSlab(tag, capacity_bytes)
    if options.use_cuda:
        return CudaChunks(slots.chunk_bytes, tag, slots.num_chunks, options.num_devices,
                          options.retired_chunk_max_s)
    return ShmChunks(slots.chunk_bytes, tag, slots.num_chunks, options.retired_chunk_max_s)


@dataclass(frozen=True, slots=True)
class ArenaOptions:
    """Where an arena's memory comes from: VRAM or shared memory (named with shm_prefix), and
    its share of the tier's node-wide budget (None: all of its capacity, up front)."""

    use_cuda: bool = False
    shm_prefix: str = "raykv"
    share: Share | None = None
    num_devices: int = 1  # GPUs the VRAM chunks spread over
    # A released device chunk that clients still map past this is freed anyway, with a
    # warning: a client in another PID namespace, or stopped (chunk_readers.py).
    retired_chunk_max_s: float = RETIRED_CHUNK_MAX_S


class MappedArena:
    """Slots of one size that clients on the node can map, grown and shrunk in chunks against
    the tier's budget (see chunks.py); without a budget, every slot is available."""

    def __init__(self, tier: str, capacity_bytes: int, slot_bytes: int,
                 options: ArenaOptions = ArenaOptions()):
        assert slot_bytes % ALIGN_BYTES == 0, "slot_bytes must be 4096-aligned"
        self.tier = tier
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.slots = ChunkedSlots(self.num_slots, slot_bytes, options.share)
        self.chunk_bytes = self.slots.chunk_bytes
        self._grants: dict[int, int] = {}
        self.slots.on_grant = self._ready_on_path
        # Chunks readied when a slot was wanted and none was free (on a reserve's path, the
        # caller waiting), and the seconds that took; grow_ahead readies the others ahead.
        self.ready_on_path_chunks, self.ready_on_path_s = 0, 0.0
        self.slots.on_release = self._release_chunk
        tag = f"{options.shm_prefix}-{tier}-{uuid.uuid4().hex[:12]}"
        self._backing = _backing(tier, self.slots, self.num_slots * slot_bytes, tag, options)
        self._retired_counted = 0  # retired bytes this arena has put in the budget
        # One file: a uint64 generation per slot, then a "held" byte per chunk (clients
        # pre-fault their mapping of held chunks, off their puts' path).
        table_bytes = max(1, self.num_slots) * GEN_BYTES + self.slots.num_chunks
        self._generations_file = SharedFile(tag + "-gen", round_up(table_bytes))
        table = np.frombuffer(self._generations_file.mmap, dtype=np.uint8)
        self.generations = table[: self.num_slots * GEN_BYTES].view(np.uint64)
        self.held = table[self.num_slots * GEN_BYTES :][: self.slots.num_chunks]

    def _chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_bytes
        return start, min(self.chunk_bytes, self.num_slots * self.slot_bytes - start)

    def ready_chunk(self, chunk: int) -> None:
        """Back a chunk with memory, faulted in (any thread: it touches no slot state)."""
        self._backing.grant(*self._chunk_range(chunk))
        self._grants[chunk] = self._grants.get(chunk, 0) + 1
        self.held[chunk] = self._grants[chunk] % 255 + 1  # changes with every grant

    async def ready_taken(self, chunk: int, executor=None) -> bool:
        """Ready a chunk its slots took for readying (take_now, take_ahead) off the event
        loop, in `executor` (None: asyncio's default), and open its slots. False when there
        was no memory to give: the chunk is dropped and the failure noted. On any other error
        it is dropped and the error raised."""
        try:
            await asyncio.get_running_loop().run_in_executor(executor, self.ready_chunk, chunk)
        except NO_MEMORY as error:
            self.slots.drop_ahead(chunk)
            self.slots.note_grant_failure(chunk, error)
            return False
        except BaseException:
            self.slots.drop_ahead(chunk)
            raise
        self.slots.open_ahead(chunk)
        return True

    def _ready_on_path(self, chunk: int) -> None:
        started_s = time.perf_counter()
        self.ready_chunk(chunk)
        self.note_ready_on_path(time.perf_counter() - started_s)

    def note_ready_on_path(self, seconds: float) -> None:
        """Count a chunk readied while a caller waited for its slots."""
        self.ready_on_path_chunks += 1
        self.ready_on_path_s += seconds

    def _release_chunk(self, chunk: int) -> None:
        self.held[chunk] = 0
        self._backing.release(*self._chunk_range(chunk))
        self.reap_retired()

    def reap_retired(self, now_s: float | None = None) -> int:
        """Free the released device chunks that no live client on the node still maps
        (device_chunks.py); returns the bytes freed. Until freed they count as used in the
        tier's budget: nothing is promised memory the GPU has not got back. Each release
        calls it; the node also calls it on its loop (reap_retired below), where the
        budget changes."""
        freed = self._backing.reap_retired(now_s)
        self._count_retired()
        return freed

    def _count_retired(self) -> None:
        retired = self._backing.retired_bytes
        self.slots.budget.retired_bytes += retired - self._retired_counted
        self._retired_counted = retired

    @property
    def retired_bytes(self) -> int:
        """Bytes of released device chunks still mapped by some client, not freed yet."""
        return self._backing.retired_bytes

    def alloc(self) -> int | None:
        return self.slots.alloc()

    def free(self, slot: int) -> None:
        self.slots.free(slot)
        self.generations[slot] += 1  # a reader still copying from it will notice

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes as a 1-D uint8 tensor (a view, no copy)."""
        return self._backing.view(slot * self.slot_bytes, self.slot_bytes)

    def generation(self, slot: int) -> int:
        return int(self.generations[slot])

    def descriptor(self) -> ArenaDescriptor:
        fields = self._backing.descriptor_fields()
        return ArenaDescriptor(self.tier, self.slot_bytes, self.num_slots,
                               fields.get("shm_path"), fields.get("device_layout"),
                               self._generations_file.path, self.chunk_bytes)

    @property
    def layout_version(self) -> int:
        """Grows whenever clients must map the arena again: a device chunk granted or
        released (each grant is a new allocation); 0 for the host slab."""
        return self._backing.version

    @property
    def used_bytes(self) -> int:
        return self.slots.num_used * self.slot_bytes

    def close(self) -> None:
        """Free the chunks, retired ones too, and unlink the shm files; shm mappings
        already open stay valid until unmapped."""
        self._backing.close()
        self._count_retired()
        self._generations_file.close()


def reap_retired(arenas: Iterable[MappedArena]) -> int:
    """reap_retired over `arenas` (the node's periodic work: run it where the tiers' budgets
    change, on the node's loop); returns the bytes freed."""
    return sum(arena.reap_retired() for arena in list(arenas))


class ArenaMapping:
    """A client's mapping of a node arena, opened once and reused. The host slab is mapped
    without populating the (sparse) file: a chunk is faulted in the first time it is used.
    The device tier's chunks are mapped one by one (device_chunks.DeviceMaps), and mapped
    again by `update` when the node's layout moved on."""

    def __init__(self, descriptor: ArenaDescriptor):
        self.descriptor = descriptor
        table = np.frombuffer(map_file(descriptor.generations_path), dtype=np.uint8)
        num_chunks = -(-descriptor.num_slots * descriptor.slot_bytes
                       // max(1, descriptor.chunk_bytes))
        self.generations = table[: descriptor.num_slots * GEN_BYTES].view(np.uint64)
        self.held = table[descriptor.num_slots * GEN_BYTES :][:num_chunks]
        self._populated: dict[int, int] = {}  # chunk -> the grant it was faulted in for
        self._mmap: mmap.mmap | None = None
        self.device: DeviceMaps | None = None
        if descriptor.device_layout is not None:
            self.device = DeviceMaps(descriptor.device_layout)
            return
        self._mmap = map_file(descriptor.shm_path, populate=False)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.array = self.tensor.numpy()  # the same bytes, for copies with no torch call

    @property
    def layout_version(self) -> int:
        return self.device.version if self.device is not None else 0

    def update(self, descriptor: ArenaDescriptor) -> None:
        """Map the chunks of a newer layout of the same arena (device tier; the host slab
        is one file for good)."""
        if self.device is not None and descriptor.device_layout is not None:
            self.device.update(descriptor.device_layout)

    def view(self, slot: int) -> torch.Tensor | None:
        """The slot's bytes; None where this process cannot map its chunk (a miss)."""
        start = slot * self.descriptor.slot_bytes
        if self.device is not None:
            return self.device.view(start, self.descriptor.slot_bytes)
        # A chunk the background pre-fault has not reached yet is faulted in here, in one
        # call: far cheaper than a page fault per 4 KiB under the copy.
        self._fault_in(start // self.descriptor.chunk_bytes)
        return self.tensor[start : start + self.descriptor.slot_bytes]

    @property
    def slots_per_chunk(self) -> int:
        return max(1, self.descriptor.chunk_bytes // self.descriptor.slot_bytes)

    def run_view(self, first_slot: int, count: int) -> torch.Tensor | None:
        """The bytes of slots first_slot..first_slot+count-1 (one chunk's, in the device tier),
        as one 1-D uint8 view; None where this process cannot map them (a miss)."""
        if self.device is not None:
            slot_bytes = self.descriptor.slot_bytes
            return self.device.view(first_slot * slot_bytes, count * slot_bytes)
        start, end = self._faulted(first_slot, count)
        return self.tensor[start:end]

    def run_array(self, first_slot: int, count: int) -> np.ndarray | None:
        """run_view's bytes as a numpy view, for a host slab; None for the device tier (its
        copies go through torch)."""
        if self.device is not None:
            return None
        start, end = self._faulted(first_slot, count)
        return self.array[start:end]

    def _faulted(self, first_slot: int, count: int) -> tuple[int, int]:
        """The host slab's byte range of slots first_slot..first_slot+count-1, its chunks
        faulted in."""
        slot_bytes, chunk_bytes = self.descriptor.slot_bytes, self.descriptor.chunk_bytes
        start, end = first_slot * slot_bytes, (first_slot + count) * slot_bytes
        for chunk in range(start // chunk_bytes, (end - 1) // chunk_bytes + 1):
            self._fault_in(chunk)
        return start, end

    def _fault_in(self, chunk: int) -> bool:
        grant = int(self.held[chunk])
        if not grant or self._populated.get(chunk) == grant:
            return False
        self._populated[chunk] = grant
        chunk_bytes = self.descriptor.chunk_bytes
        length = min(chunk_bytes, len(self._mmap) - chunk * chunk_bytes)
        populate_range(self.tensor.data_ptr() + chunk * chunk_bytes, length)
        return True

    def prefault_held(self) -> int:
        """Fault in this mapping's pages of every chunk the node holds (and has populated)
        that this mapping has not faulted yet: a first write then runs at memory speed.
        Returns how many chunks it did. Chunks not held are never touched (the file is
        sparse: touching them would take memory outside the node's budget)."""
        if self.device is not None:
            return self.device.prefault()
        return sum(self._fault_in(chunk) for chunk in np.flatnonzero(self.held).tolist())

    def generation(self, slot: int) -> int:
        return int(self.generations[slot])


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


def cupy_available() -> bool:
    """Whether cupy (the VRAM chunks' CUDA runtime bindings) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def num_cuda_devices() -> int:
    """GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
