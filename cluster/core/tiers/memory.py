"""Memory tiers that same-node clients map directly: host shared memory and device memory.

    slab:        | chunk 0          | chunk 1 (not held) | chunk 2          | ...
                 | slot 0 | slot 1  |                    | slot 4 | slot 5  |   4096-aligned
    generations: | g0 | g1 | g2 | ... |                                uint64, one per slot

An arena spans its pool's whole possible capacity, but holds memory only for the chunks its
pool was granted from the tier's node-wide budget (chunks.py): the shared-memory file is sparse,
a granted chunk is populated, a released one punched out; on a GPU each chunk is its own VRAM
allocation from cupy's pool. That is how models share one budget elastically.

The host tier is a file in /dev/shm mapped by the node actor and by every client on the node,
so a get is one copy from the slab into the caller's tensor, with no hop through Ray.
The device tier is a CUDA allocation when a GPU is visible (clients map it through a CUDA
IPC handle); without one it is a CPU stand-in with the same shared-memory mechanics.

A slot's generation grows each time the slot is freed. A reader notes it when the node pins
the page for it and checks it again after its copy: a changed generation means the slot was
freed (its lease ran out) and perhaps reused while the copy ran, so the copy is a miss.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cluster.core.tiers.aligned import ALIGN_BYTES, round_up
from cluster.core.tiers.chunks import ChunkedSlots, Share

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
    chunk_bytes: int = 0


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


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class _SharedFile:
    """A file in shared memory, mapped read-write; unlinked by close(). Sparse: memory is
    taken only for what is written (or populated)."""

    def __init__(self, name: str, nbytes: int, populate: bool = True):
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            flags = mmap.MAP_SHARED | (_populate() if populate else 0)
            self.mmap = mmap.mmap(fd, nbytes, flags=flags)
        finally:
            os.close(fd)

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _map_file(path: str, populate: bool = True) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | (_populate() if populate else 0)
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=flags)
    finally:
        os.close(fd)


def _advise(mapping: mmap.mmap, advice: int, start: int, length: int) -> bool:
    try:
        mapping.madvise(advice, start, length)
        return True
    except (OSError, ValueError):
        return False


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _populate_range(address: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over [address, address + length), without holding the GIL
    (mmap.madvise holds it for the whole call: tens of ms for a chunk, which would stall every
    other thread of the process, the actor's event loop included). False where the kernel
    lacks it (before 5.14)."""
    return _libc.madvise(address, length, MADV_POPULATE_WRITE) == 0


class _ShmSlab:
    """The CPU backing of an arena: one sparse shared-memory file over the whole capacity.
    A granted chunk is populated (faulted in) at once; a released one is punched out, so
    the memory goes back to the machine while the file keeps its size."""

    def __init__(self, name: str, nbytes: int):
        self.file = _SharedFile(name, max(nbytes, ALIGN_BYTES), populate=False)
        _advise_hugepages(self.file.mmap)
        self.tensor = torch.frombuffer(self.file.mmap, dtype=torch.uint8)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def grant(self, offset: int, nbytes: int) -> None:
        if not _populate_range(self.tensor.data_ptr() + offset, nbytes):
            self.tensor[offset : offset + nbytes].zero_()  # older kernels: touch it

    def release(self, offset: int, nbytes: int) -> None:
        _advise(self.file.mmap, mmap.MADV_REMOVE, offset, nbytes)

    def descriptor_fields(self) -> dict:
        return {"shm_path": self.file.path}

    def close(self) -> None:
        self.file.close()


class _CudaChunks:
    """The GPU backing of an arena: one VRAM allocation per granted chunk, taken from cupy's
    memory pool (so a released chunk is VRAM other models and the engine can use), each
    shared with same-node clients through a CUDA IPC handle. Chunks go round-robin over the
    node's GPUs (chunk c on GPU c % num_devices): a VRAM pool on every GPU. Written for real,
    guarded: it runs only where cupy and a GPU are present."""

    def __init__(self, chunk_bytes: int, num_devices: int = 1):
        import cupy

        self.cupy = cupy
        self.chunk_bytes = chunk_bytes
        self.num_devices = max(1, num_devices)
        self.chunks: dict[int, tuple[object, torch.Tensor]] = {}
        self.version = 0

    def device_of(self, chunk: int) -> int:
        return chunk % self.num_devices

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        chunk, within = divmod(offset, self.chunk_bytes)
        return self.chunks[chunk][1][within : within + nbytes]

    def grant(self, offset: int, nbytes: int) -> None:
        chunk = offset // self.chunk_bytes
        with self.cupy.cuda.Device(self.device_of(chunk)) as device:
            memory = self.cupy.cuda.alloc(nbytes)
            array = self.cupy.ndarray((nbytes,), dtype=self.cupy.uint8, memptr=memory)
            array.fill(0)
            device.synchronize()  # a client mapping it sees initialized memory
            self.chunks[chunk] = (memory, torch.as_tensor(array, device=f"cuda:{device.id}"))
        self.version += 1

    def release(self, offset: int, nbytes: int) -> None:
        chunk = offset // self.chunk_bytes
        with self.cupy.cuda.Device(self.device_of(chunk)) as device:
            device.synchronize()  # no copy may still read it
        self.chunks.pop(chunk, None)  # back to cupy's pool
        self.version += 1

    def descriptor_fields(self) -> dict:
        handles = {chunk: (self.device_of(chunk),
                           self.cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
                   for chunk, (memory, _) in self.chunks.items()}
        return {"cuda_handle": {"chunk_bytes": self.chunk_bytes, "chunks": handles,
                                "version": self.version}}

    def close(self) -> None:
        self.chunks.clear()


@dataclass(frozen=True, slots=True)
class ArenaOptions:
    """Where an arena's memory comes from: VRAM or shared memory (named with shm_prefix), and
    its share of the tier's node-wide budget (None: all of its capacity, up front)."""

    use_cuda: bool = False
    shm_prefix: str = "raykv"
    share: Share | None = None
    num_devices: int = 1  # GPUs the VRAM chunks spread over


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
        self.slots.on_grant = self.ready_chunk
        self.slots.on_release = self._release_chunk
        tag = f"{options.shm_prefix}-{tier}-{uuid.uuid4().hex[:12]}"
        self._backing = (_CudaChunks(self.chunk_bytes, options.num_devices) if options.use_cuda
                         else _ShmSlab(tag, self.num_slots * slot_bytes))
        # One file: a uint64 generation per slot, then a "held" byte per chunk (clients
        # pre-fault their mapping of held chunks, off their puts' path).
        table_bytes = max(1, self.num_slots) * GEN_BYTES + self.slots.num_chunks
        self._generations_file = _SharedFile(tag + "-gen", round_up(table_bytes))
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

    def _release_chunk(self, chunk: int) -> None:
        self.held[chunk] = 0
        self._backing.release(*self._chunk_range(chunk))

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
                               fields.get("shm_path"), fields.get("cuda_handle"),
                               self._generations_file.path, self.chunk_bytes)

    @property
    def layout_version(self) -> int:
        """Changes when clients must map the arena again (new VRAM chunks); 0 on CPU."""
        return getattr(self._backing, "version", 0)

    @property
    def used_bytes(self) -> int:
        return self.slots.num_used * self.slot_bytes

    def close(self) -> None:
        """Unlink the shm files; mappings already open stay valid until unmapped."""
        self._backing.close()
        self._generations_file.close()


class ArenaMapping:
    """A client's mapping of a node arena, opened once and reused. Shared memory is mapped
    without populating the (sparse) file; a chunk is faulted in the first time it is used."""

    def __init__(self, descriptor: ArenaDescriptor):
        self.descriptor = descriptor
        table = np.frombuffer(_map_file(descriptor.generations_path), dtype=np.uint8)
        num_chunks = -(-descriptor.num_slots * descriptor.slot_bytes
                       // max(1, descriptor.chunk_bytes))
        self.generations = table[: descriptor.num_slots * GEN_BYTES].view(np.uint64)
        self.held = table[descriptor.num_slots * GEN_BYTES :][:num_chunks]
        self._populated: dict[int, int] = {}  # chunk -> the grant it was faulted in for
        self._mmap: mmap.mmap | None = None
        if descriptor.cuda_handle is not None:
            self._cuda = _map_cuda_chunks(descriptor.cuda_handle)
            return
        self._mmap = _map_file(descriptor.shm_path, populate=False)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def view(self, slot: int) -> torch.Tensor:
        start = slot * self.descriptor.slot_bytes
        if self._mmap is None:
            chunk, within = divmod(start, self.descriptor.chunk_bytes)
            return self._cuda[chunk][within : within + self.descriptor.slot_bytes]
        # A chunk the background pre-fault has not reached yet is faulted in here, in one
        # call: far cheaper than a page fault per 4 KiB under the copy.
        self._fault_in(start // self.descriptor.chunk_bytes)
        return self.tensor[start : start + self.descriptor.slot_bytes]

    def _fault_in(self, chunk: int) -> bool:
        grant = int(self.held[chunk])
        if not grant or self._populated.get(chunk) == grant:
            return False
        self._populated[chunk] = grant
        chunk_bytes = self.descriptor.chunk_bytes
        length = min(chunk_bytes, len(self._mmap) - chunk * chunk_bytes)
        _populate_range(self.tensor.data_ptr() + chunk * chunk_bytes, length)
        return True

    def prefault_held(self) -> int:
        """Fault in this mapping's pages of every chunk the node holds (and has populated)
        that this mapping has not faulted yet: a first write then runs at memory speed.
        Returns how many chunks it did. Chunks not held are never touched (the file is
        sparse: touching them would take memory outside the node's budget)."""
        if self._mmap is None:
            return 0
        return sum(self._fault_in(chunk) for chunk in np.flatnonzero(self.held).tolist())

    def generation(self, slot: int) -> int:
        return int(self.generations[slot])


def _map_cuda_chunks(handle: dict) -> dict[int, torch.Tensor]:
    """Open each chunk's CUDA IPC handle (cupy), on the GPU that holds it, as a uint8 tensor."""
    import cupy

    chunks = {}
    for chunk, (device, ipc) in handle["chunks"].items():
        with cupy.cuda.Device(device):
            pointer = cupy.cuda.runtime.ipcOpenMemHandle(ipc)
            memory = cupy.cuda.UnownedMemory(pointer, handle["chunk_bytes"], owner=None)
            array = cupy.ndarray((handle["chunk_bytes"],), dtype=cupy.uint8,
                                 memptr=cupy.cuda.MemoryPointer(memory, 0))
            chunks[chunk] = torch.as_tensor(array, device=f"cuda:{device}")
    return chunks


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
