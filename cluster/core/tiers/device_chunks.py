"""The device tier's memory: one separate allocation per chunk, shared with same-node clients.

    node actor                                   client (a Serve replica, a vLLM worker)
    grant(chunk)    a new allocation  --.         DeviceLayout(version, per chunk: grant id,
    release(chunk)  retired             |-->        GPU UUID, IPC handle or shm file,
    version += 1 on each              --'           offset, nbytes)
    reap_retired()  frees the retired             maps the chunks it can; the rest are misses
                    no client can map

A chunk granted again is a new allocation (a new IPC handle, a new shm file), so a client's
old mapping of it is stale: every reserve and acquire reply carries the layout version, and a
client whose mapping is older maps again before it copies (cluster/slabs.py).

A released chunk is not freed at once: a client may still map it, and CUDA leaves freeing an
allocation another process maps undefined. It is retired, still counted as used, until every
live client on the node has closed its mapping, which each client does with no call, on its
own (chunk_readers.py); the node frees it on its periodic work (reap_retired) or its next
release.

Two backings with one shape of descriptor:
    CudaChunks   cudaMalloc per chunk, never a sub-block of a framework pool (an IPC handle
                 maps its allocation's base), cudaFree once released and unmapped (back to
                 the driver, for the engines); a client opens it with cudaIpcOpenMemHandle
                 on the GPU of the same UUID and closes it once its last view of the mapping
                 is gone.
    ShmChunks    the CPU stand-in: a shared-memory file per chunk, made on each grant and
                 unlinked once released and unmapped (the retiring is the same code).
The chunk table is changed under a lock: chunks are readied ahead of need in a thread
(NodeStore.grow_ahead) while the event loop reads the table.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from cluster.core.tiers.chunk_readers import (
    RETIRED_CHUNK_MAX_S,
    Listing,
    NodeReaders,
    ReaderSlot,
    RetiredChunks,
    open_while_alive,
)
from cluster.core.tiers.gpus import local_gpu_uuids, local_index
from cluster.core.tiers.shm import SharedFile, map_file, populate_range

log = logging.getLogger("raykv.tiers")


@dataclass(frozen=True, slots=True)
class ChunkHandle:
    """One granted chunk: where it lies in the arena and how a client maps it."""

    chunk: int
    grant: int  # unique per allocation: a chunk granted again gets a new one
    offset_bytes: int  # of the chunk's first byte in the arena
    nbytes: int  # exactly the allocation's size (a short last chunk is short)
    gpu_uuid: str | None = None
    ipc_handle: bytes | None = None  # cudaIpcMemHandle_t (CudaChunks)
    shm_path: str | None = None  # (ShmChunks)


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    """Every granted chunk of an arena, as of `version`."""

    version: int
    chunk_bytes: int
    chunks: tuple[ChunkHandle, ...]
    readers_path: str | None = None  # the arena's readers file (chunk_readers.py)


@dataclass(slots=True)
class _Held:
    handle: ChunkHandle
    tensor: torch.Tensor
    resource: object  # a SharedFile, or a (device index, pointer) of VRAM


_grant_ids = itertools.count(1)  # process-wide: two arenas never hand out the same id


class _Chunks:
    """The chunk table shared by both backings, with the released chunks still retired and
    the readers file that tells which can go; subclasses allocate and free."""

    def __init__(self, chunk_bytes: int, tag: str, num_chunks: int,
                 retired_max_s: float = RETIRED_CHUNK_MAX_S):
        self.chunk_bytes = chunk_bytes
        self.version = 0
        self._lock = threading.Lock()
        self._table: dict[int, _Held] = {}
        self.readers = NodeReaders(f"{tag}-readers", num_chunks)
        self._retired = RetiredChunks(self.readers, retired_max_s)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        chunk, within = divmod(offset, self.chunk_bytes)
        with self._lock:
            held = self._table.get(chunk)
        assert held is not None, f"byte {offset} is in chunk {chunk}, which is not held"
        return held.tensor[within : within + nbytes]

    def grant(self, offset: int, nbytes: int) -> None:
        """Allocate the chunk at `offset` (slow: outside the lock), then publish it."""
        chunk = offset // self.chunk_bytes
        held = self._allocate(chunk, offset, nbytes, next(_grant_ids))
        with self._lock:
            assert chunk not in self._table, f"chunk {chunk} granted twice"
            self._table[chunk] = held
            self.version += 1
            self.readers.publish(self.version, chunk, held.handle.grant)

    def release(self, offset: int, nbytes: int) -> None:
        """Take the chunk out of the layout; its memory is retired until reap_retired finds
        that no live client can still map it."""
        chunk = offset // self.chunk_bytes
        with self._lock:
            held = self._table.pop(chunk, None)
            self.version += 1
            self.readers.publish(self.version, chunk, 0)
            if held is not None:
                self._retired.add(held, held.handle.nbytes, self.version, time.monotonic())

    def reap_retired(self, now_s: float | None = None) -> int:
        """Free the retired chunks that every live client has stopped mapping (or that
        waited retired_max_s by `now_s`, time.monotonic()'s); returns the bytes freed."""
        freed = 0
        for held in self._retired.due(time.monotonic() if now_s is None else now_s):
            self._free(held)
            freed += held.handle.nbytes
        return freed

    @property
    def retired_bytes(self) -> int:
        """Bytes of released chunks not freed yet (still taken from the GPU)."""
        return self._retired.retired_bytes

    def layout(self) -> DeviceLayout:
        with self._lock:
            chunks = tuple(self._table[c].handle for c in sorted(self._table))
            return DeviceLayout(self.version, self.chunk_bytes, chunks, self.readers.path)

    def descriptor_fields(self) -> dict:
        return {"device_layout": self.layout()}

    def close(self) -> None:
        """Free every chunk, retired or not (the node shuts down)."""
        with self._lock:
            held, self._table = list(self._table.values()), {}
            self.version += 1
            self.readers.withdraw_all(self.version)
        for one in held + self._retired.take_all():
            self._free(one)
        self.readers.close()

    def _allocate(self, chunk: int, offset: int, nbytes: int, grant: int) -> _Held:
        raise NotImplementedError

    def _free(self, held: _Held) -> None:
        raise NotImplementedError


class ShmChunks(_Chunks):
    """The CPU stand-in: a shared-memory file per granted chunk, populated at once."""

    def __init__(self, chunk_bytes: int, tag: str, num_chunks: int,
                 retired_max_s: float = RETIRED_CHUNK_MAX_S):
        super().__init__(chunk_bytes, tag, num_chunks, retired_max_s)
        self.tag = tag

    def _allocate(self, chunk: int, offset: int, nbytes: int, grant: int) -> _Held:
        shared = SharedFile(f"{self.tag}-c{chunk}-g{grant}", nbytes, populate=True)
        handle = ChunkHandle(chunk, grant, offset, nbytes, shm_path=shared.path)
        return _Held(handle, torch.frombuffer(shared.mmap, dtype=torch.uint8), shared)

    def _free(self, held: _Held) -> None:
        held.resource.close()  # unlinked; the memory goes once the last mapping is gone


class _GpuLedger:
    """Bytes this process holds on each GPU it sees: a chunk goes to the least-filled one,
    so `device_bytes` per GPU holds whichever pools (arenas) the chunks belong to."""

    def __init__(self):
        self._lock = threading.Lock()
        self.held_bytes: dict[int, int] = {}

    def take(self, num_devices: int, nbytes: int) -> int:
        with self._lock:
            index = min(range(num_devices), key=lambda i: (self.held_bytes.get(i, 0), i))
            self.held_bytes[index] = self.held_bytes.get(index, 0) + nbytes
            return index

    def give(self, index: int, nbytes: int) -> None:
        with self._lock:
            self.held_bytes[index] -= nbytes


_ledger = _GpuLedger()


class CudaChunks(_Chunks):
    """VRAM: one cudaMalloc per granted chunk (cupy's runtime bindings), over the process's
    GPUs, each exported with an IPC handle. Written for real, guarded: only where cupy and a
    GPU are present (tests/unit/test_gpu.py, `make gpu-check`)."""

    def __init__(self, chunk_bytes: int, tag: str, num_chunks: int, num_devices: int = 1,
                 retired_max_s: float = RETIRED_CHUNK_MAX_S):
        import cupy

        self.runtime = cupy.cuda.runtime
        self.uuids = local_gpu_uuids()
        assert self.uuids, "CudaChunks needs a visible GPU"
        self.num_devices = max(1, min(num_devices, len(self.uuids)))
        super().__init__(chunk_bytes, tag, num_chunks, retired_max_s)

    def _allocate(self, chunk: int, offset: int, nbytes: int, grant: int) -> _Held:
        device = _ledger.take(self.num_devices, nbytes)
        try:
            pointer = self._malloc(device, nbytes)
        except BaseException:
            _ledger.give(device, nbytes)
            raise
        ipc = bytes(self.runtime.ipcGetMemHandle(pointer))
        handle = ChunkHandle(chunk, grant, offset, nbytes, self.uuids[device], ipc_handle=ipc)
        tensor = torch.as_tensor(DevicePointer(pointer, nbytes), device=f"cuda:{device}")
        return _Held(handle, tensor, (device, pointer))

    def _malloc(self, device: int, nbytes: int) -> int:
        previous = self.runtime.getDevice()
        self.runtime.setDevice(device)
        try:
            pointer = self.runtime.malloc(nbytes)
            self.runtime.memset(pointer, 0, nbytes)
            self.runtime.deviceSynchronize()  # a client mapping it sees initialized memory
            return pointer
        finally:
            self.runtime.setDevice(previous)

    def _free(self, held: _Held) -> None:
        device, pointer = held.resource
        previous = self.runtime.getDevice()
        self.runtime.setDevice(device)
        try:
            torch.cuda.synchronize(device)  # no copy may still be queued on it
            self.runtime.free(pointer)
        finally:
            self.runtime.setDevice(previous)
            _ledger.give(device, held.handle.nbytes)


class _Closing:
    """Whether an IPC mapping is still open: set once cudaIpcCloseMemHandle has run (not
    when the pointer is collected, a moment before)."""

    def __init__(self):
        self.closed = False

    def is_open(self) -> bool:
        return not self.closed


class DevicePointer:
    """Raw VRAM as a 1-D uint8 array (__cuda_array_interface__), for torch.as_tensor: the
    tensor and every view of it keep this object alive, and an IPC mapping's finalizer
    (open_ipc) closes it only once all of them are gone."""

    def __init__(self, pointer: int, nbytes: int):
        self.pointer = pointer
        self.nbytes = nbytes
        self.closing = _Closing()  # (an IPC mapping's: open_ipc)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.pointer, False),
                "strides": None, "version": 2}


# ---- the client's side --------------------------------------------------------------------


@dataclass(slots=True)
class _Mapped:
    grant: int
    tensor: torch.Tensor | None  # None: this process cannot map the chunk (a miss)
    populated: bool = False


class DeviceMaps:
    """A client's mappings of one device arena's chunks, as of one layout version.

    `update(layout)` keeps the mappings whose grant is unchanged, drops the others (a mapping
    is closed once the last copy through it is done) and maps the new ones it can: a chunk on
    a GPU this process does not see, or one already released, stays unmapped, and `view`
    answers None for its slots. Between replies, this process's poller drops the mappings of
    chunks the node has released since (drop_unlisted) and tells the node once they are
    closed (chunk_readers.py), so that it can free them. Without a slot in the arena's
    readers file nothing is mapped: every view is a miss.
    """

    def __init__(self, layout: DeviceLayout):
        self.chunk_bytes = layout.chunk_bytes
        self.version = -1
        self._maps: dict[int, _Mapped] = {}
        self._uuids: list[str] | None = None
        self._slot = ReaderSlot.open(layout.readers_path)
        self._lock = self._slot.lock if self._slot is not None else threading.Lock()
        if self._slot is not None:
            self._slot.follow(self.drop_unlisted)
        self.update(layout)

    def update(self, layout: DeviceLayout) -> None:
        with self._lock:
            if layout.version <= self.version:
                return
            listing = self._slot.listing() if self._slot is not None else None
            maps = {}
            for handle in layout.chunks:
                old = self._maps.get(handle.chunk)
                maps[handle.chunk] = (old if old is not None and old.grant == handle.grant
                                      else _Mapped(handle.grant, self._open_listed(handle,
                                                                                   listing)))
            self._maps = maps
            self.version = layout.version
            if listing is not None:
                self.drop_unlisted(listing)
                self._slot.catch_up(listing)

    def drop_unlisted(self, listing: Listing) -> None:
        """Drop (under the slot's lock) the mappings of chunks the node has released since
        this client's layout: each closes once its last view is gone, and its slots miss
        until a reply with a newer layout maps the chunk again."""
        self._maps = {chunk: mapped for chunk, mapped in self._maps.items()
                      if listing.lists(chunk, mapped.grant)}

    def view(self, offset: int, nbytes: int) -> torch.Tensor | None:
        chunk, within = divmod(offset, self.chunk_bytes)
        mapped = self._maps.get(chunk)
        if mapped is None or mapped.tensor is None:
            return None
        if not mapped.populated:
            self._populate(mapped)
        return mapped.tensor[within : within + nbytes]

    def prefault(self) -> int:
        """Fault in the shm chunks mapped but not touched yet; returns how many."""
        todo = [m for m in list(self._maps.values()) if m.tensor is not None and not m.populated]
        for mapped in todo:
            self._populate(mapped)
        return len(todo)

    @property
    def mapped_chunks(self) -> dict[int, int]:
        """chunk -> grant of every chunk this client maps."""
        return {c: m.grant for c, m in self._maps.items() if m.tensor is not None}

    def catch_up(self) -> int | None:
        """Do now what this process's poller does every POLL_S (drop the mappings of chunks
        released since, tell the node what is closed); the version this client is caught up
        to (None: no slot)."""
        if self._slot is None:
            return None
        self._slot.poll()
        return self._slot.caught_up

    @property
    def caught_up(self) -> int | None:
        """The layout version this client told the node it has caught up to (None: no
        slot)."""
        return self._slot.caught_up if self._slot is not None else None

    def _populate(self, mapped: _Mapped) -> None:
        mapped.populated = True
        if not mapped.tensor.is_cuda:  # one call, not a page fault per 4 KiB under a copy
            populate_range(mapped.tensor.data_ptr(), mapped.tensor.numel())

    def _open_listed(self, handle: ChunkHandle, listing: Listing | None) -> torch.Tensor | None:
        """Open a chunk the node still holds (as the listing, read before, says): a chunk
        released since may be freed at any time, so it is not opened (a miss)."""
        if listing is None or not listing.lists(handle.chunk, handle.grant):
            return None
        return self._open(handle)

    def _open(self, handle: ChunkHandle) -> torch.Tensor | None:
        try:
            if handle.shm_path is not None:
                mapping = map_file(handle.shm_path, populate=False)
                self._track(handle, open_while_alive(mapping))
                return torch.frombuffer(mapping, dtype=torch.uint8)
            return self._open_ipc(handle)
        except (OSError, RuntimeError, ValueError) as error:  # released meanwhile, no such
            # GPU here, or a GPU whose UUID this process cannot read whole (gpus.format_uuid)
            log.warning("device chunk %d (grant %d) not mapped, its pages miss: %s",
                        handle.chunk, handle.grant, error)
            return None

    def _open_ipc(self, handle: ChunkHandle) -> torch.Tensor | None:
        if self._uuids is None:
            self._uuids = local_gpu_uuids()
        device = local_index(handle.gpu_uuid, self._uuids)
        if device is None:
            return None  # a GPU this process does not see
        pointer = open_ipc(handle.ipc_handle, device, handle.nbytes)
        self._track(handle, pointer.closing.is_open)
        return torch.as_tensor(pointer, device=f"cuda:{device}")

    def _track(self, handle: ChunkHandle, is_open) -> None:
        if self._slot is not None:
            self._slot.track(handle.chunk, handle.grant, is_open)


_opened: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()


def open_ipc(ipc_handle: bytes, device: int, nbytes: int) -> DevicePointer:
    """Open a CUDA IPC handle on this process's GPU `device`, once per process (CUDA refuses
    a second open of one handle in a context); closed when no mapping uses it any more."""
    import cupy

    with _opened_lock:
        pointer = _opened.get(ipc_handle)
        if pointer is not None:
            return pointer
        runtime = cupy.cuda.runtime
        previous = runtime.getDevice()
        runtime.setDevice(device)
        try:
            address = runtime.ipcOpenMemHandle(ipc_handle)
        finally:
            runtime.setDevice(previous)
        pointer = DevicePointer(address, nbytes)
        weakref.finalize(pointer, _close_ipc, address, device, pointer.closing)
        _opened[ipc_handle] = pointer
        return pointer


def _close_ipc(address: int, device: int, closing: _Closing) -> None:
    import cupy

    runtime = cupy.cuda.runtime
    previous = runtime.getDevice()
    runtime.setDevice(device)
    try:
        runtime.ipcCloseMemHandle(address)
    except RuntimeError as error:  # at exit, the context may be gone already
        log.debug("ipcCloseMemHandle: %s", error)
    finally:
        runtime.setDevice(previous)
        closing.closed = True
