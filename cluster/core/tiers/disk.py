"""Disk tier: fixed-size slots in slab files, read and written with O_DIRECT.

    slab-00000.bin: | slot 0 | slot 1 | ... | slot k-1 |   k = slots_per_file (files <= ~1 GiB)
    slab-00001.bin: | slot k | slot k+1 | ...          |
    slot:           | header block 4096 | payload, rounded up to 4096 |
    header:         the page's key, codec, sizes, checksums and namespace (disk_format.py)

A batch of pages goes out (or comes back) in parallel: os.pwritev/os.preadv in a small thread
pool, which release the GIL, through pooled 4096-aligned buffers. A page whose header or payload
fails its checksum (or a short read: a torn slab) reads as None, a miss, and is counted in
checksum_failures. manifest.json pins the geometry; reopening with
another one raises ValueError.

Durability (set_durability): "durable" fdatasyncs the slab files a batch wrote before
write_pages returns, so a page its caller then reports on disk survives a power cut;
"volatile" leaves write-back to the device, so a power cut may lose pages written shortly
before it (a torn page fails its checksum: a miss, never wrong bytes). Either way the writes
have reached the kernel, so a crash of the process loses nothing.

    free(slot) -> freed [s, s]  --flush_freed() (a thread): zero the headers-->  free slots

A freed slot is not handed out again until its header is zeroed, so that a page discarded
or evicted does not come back from scan() after a restart (nor can the zeroing land on a new
page). The zeroing is batched: the pool flushes before it needs disk room, the store on its
periodic tidy, close() at the end; a crash in between may bring back a page freed just
before it (whose bytes are still that page's).

The slab files are sparse. A chunk of slots gets real blocks (fallocate) when the disk tier's
node-wide budget grants it to this arena, and gives them back (a punched hole) when released,
so every model's pages share one disk budget (see chunks.py).

DiskArena's reads, writes and restart scan are mixins of their own (disk_reads.py,
disk_writes.py, disk_scan.py), beside its runs of adjacent slots (disk_runs.py). The names
that moved out stay importable from here: the `name as name` imports.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from cluster.core.faults import DiskFaults
from cluster.core.keys import KEY_BYTES as KEY_BYTES
from cluster.core.tiers.aligned import ALIGN_BYTES as ALIGN_BYTES
from cluster.core.tiers.aligned import (
    AlignedBufferPool,
    aligned_empty,
    allocate_range,
    direct_reads_work,
    fsync_dir,
    make_private_dir,
    open_private,
    punch_hole,
    pwritev_all,
    round_up,
)
from cluster.core.tiers.aligned import is_aligned as is_aligned
from cluster.core.tiers.chunks import ChunkedSlots, Share
from cluster.core.tiers.disk_format import FORMAT_VERSION, HEADER_BYTES, ensure_manifest
from cluster.core.tiers.disk_format import MAX_CODEC as MAX_CODEC
from cluster.core.tiers.disk_format import DiskPageMeta as DiskPageMeta
from cluster.core.tiers.disk_format import check_bytes as check_bytes
from cluster.core.tiers.disk_format import check_namespace as check_namespace
from cluster.core.tiers.disk_format import pack_header as pack_header
from cluster.core.tiers.disk_format import parse_header as parse_header
from cluster.core.tiers.disk_format import payload_checksum as payload_checksum
from cluster.core.tiers.disk_reads import DiskReads
from cluster.core.tiers.disk_reads import _checksum as _checksum
from cluster.core.tiers.disk_runs import DiskRuns
from cluster.core.tiers.disk_scan import SCAN_CHUNK_SLOTS as SCAN_CHUNK_SLOTS
from cluster.core.tiers.disk_scan import DiskScan
from cluster.core.tiers.disk_slots import SlabSlots, open_slabs, slab_path
from cluster.core.tiers.disk_writes import DiskWrites

logger = logging.getLogger(__name__)

MAX_SLAB_FILE_BYTES = 1 << 30
_O_DIRECT = getattr(os, "O_DIRECT", 0)


DURABILITY_MODES = ("durable", "volatile")


def _fdatasync_all(fds: set[int]) -> int:
    for fd in fds:
        os.fdatasync(fd)
    return 1


def _no_sync(fds: set[int]) -> int:
    return 0


SYNCS = {"durable": _fdatasync_all, "volatile": _no_sync}


def _open_file(path: str, flags: int) -> int:
    return open_private(path, flags)


class DiskArena(DiskReads, DiskScan, DiskWrites, DiskRuns, SlabSlots):
    """Fixed-size page slots in slab files under `dir_path`, addressed by slot id.

    Thread-safe: alloc/free and the counters take a lock, and batches may run concurrently
    as long as no two of them touch the same slot. A batch's adjacent slots go in runs, one
    preadv / pwritev each (disk_runs.py). The reads, writes and scan are mixins of their own
    (disk_reads.py, disk_writes.py, disk_scan.py); this class owns the slabs, the slots and
    the counters.
    """

    def __init__(self, dir_path: str | os.PathLike, capacity_bytes: int,
                 slot_payload_bytes: int, num_threads: int = 4, share: Share | None = None
                 ) -> None:
        if slot_payload_bytes <= 0 or num_threads <= 0:
            raise ValueError(f"slot_payload_bytes ({slot_payload_bytes}) and num_threads "
                             f"({num_threads}) must be > 0")
        self.dir_path = os.fspath(dir_path)
        self.slot_payload_bytes = slot_payload_bytes
        self._span_bytes = round_up(slot_payload_bytes)  # the payload region of a slot
        self.slot_bytes = HEADER_BYTES + self._span_bytes
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots == 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} holds no slot of "
                             f"{self.slot_bytes} bytes")
        self.slots_per_file = max(1, MAX_SLAB_FILE_BYTES // self.slot_bytes)
        self.num_files = -(-self.num_slots // self.slots_per_file)
        self.direct_io = True
        self._lock = threading.Lock()
        self._slots = ChunkedSlots(self.num_slots, self.slot_bytes, share)
        self._slots.on_grant = self._allocate_chunk
        self._slots.on_release = self._punch_chunk
        self.bytes_read = 0  # bytes moved from disk, headers and 4096 padding included
        self.bytes_written = 0  # bytes moved to disk, likewise
        self.checksum_failures = 0  # slots read that did not verify: damaged or torn pages
        make_private_dir(self.dir_path)
        ensure_manifest(self.dir_path, self._geometry())
        self._fds = self._open_slabs()
        self._small = AlignedBufferPool(2 * HEADER_BYTES, max_buffers=2 * num_threads)
        self._staging = AlignedBufferPool(self._span_bytes, max_buffers=2 * num_threads)
        self.num_threads = num_threads
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="raykv-disk")
        self._closed = False
        self._freed: list[int] = []  # freed slots whose headers are not zeroed yet
        self._zero_header = aligned_empty(HEADER_BYTES)  # all zeros
        self.durability = "durable"
        self._sync = SYNCS["durable"]
        self.num_syncs = 0  # fdatasync batches (durable mode)
        self.faults: DiskFaults | None = None  # test-only (cluster/core/faults.py)

    def set_durability(self, mode: str) -> None:
        """"durable": fdatasync each write batch's slab files before write_pages returns;
        "volatile": never (see the module's docstring). ValueError for another mode."""
        if mode not in SYNCS:
            raise ValueError(f"disk durability must be one of {DURABILITY_MODES}, got {mode!r}")
        self.durability, self._sync = mode, SYNCS[mode]

    def _geometry(self) -> dict[str, int | str]:
        return {"format": "raykv-disk-slabs", "version": FORMAT_VERSION,
                "header_bytes": HEADER_BYTES, "slot_payload_bytes": self.slot_payload_bytes,
                "slot_bytes": self.slot_bytes, "num_slots": self.num_slots,
                "slots_per_file": self.slots_per_file, "num_files": self.num_files}

    def _slab_size_bytes(self, index: int) -> int:
        first_slot = index * self.slots_per_file
        return min(self.slots_per_file, self.num_slots - first_slot) * self.slot_bytes

    def _open_slabs(self) -> list[int]:
        if not _O_DIRECT:
            self._fall_back("this platform has no O_DIRECT")
        fds = open_slabs(self.num_files, self._open_slab)
        fsync_dir(self.dir_path)  # the slab files' entries (and sizes), durable
        return fds

    def _open_slab(self, index: int) -> int:
        path = slab_path(self.dir_path, index)
        fd = self._open_fd(path)
        size_bytes = self._slab_size_bytes(index)
        if os.fstat(fd).st_size < size_bytes:
            os.ftruncate(fd, size_bytes)  # sparse: blocks come with the chunks granted
        if self.direct_io and not direct_reads_work(fd):
            os.close(fd)
            self._fall_back(f"O_DIRECT reads fail on {path}")
            fd = self._open_fd(path)
        return fd

    def _open_fd(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if self.direct_io:
            try:
                return _open_file(path, flags | _O_DIRECT)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self._fall_back(f"O_DIRECT refused in {self.dir_path} ({error.strerror})")
        return _open_file(path, flags)

    def _fall_back(self, reason: str) -> None:
        if self.direct_io:
            self.direct_io = False
            warnings.warn(f"{reason}; the disk tier uses buffered I/O", RuntimeWarning,
                          stacklevel=2)

    def alloc(self) -> int | None:
        """A free slot; None when the budget (or the filesystem) has no room for one."""
        with self._lock:
            try:
                return self._slots.alloc()
            except OSError as error:  # ENOSPC while giving a new chunk its blocks
                logger.warning("disk tier in %s: no room for a new chunk: %s", self.dir_path,
                               error)
                return None

    def _chunk_segments(self, chunk: int) -> list[tuple[int, int, int]]:
        """(fd, offset, length) runs of a chunk's slots, split at slab-file boundaries."""
        segments: list[tuple[int, int, int]] = []
        for slot in self._slots.slots_of(chunk):
            fd, offset = self._locate(slot)
            if segments and segments[-1][0] == fd and sum(segments[-1][1:]) == offset:
                segments[-1] = (fd, segments[-1][1], segments[-1][2] + self.slot_bytes)
            else:
                segments.append((fd, offset, self.slot_bytes))
        return segments

    def _allocate_chunk(self, chunk: int) -> None:
        for fd, offset, length in self._chunk_segments(chunk):
            allocate_range(fd, offset, length)

    def _punch_chunk(self, chunk: int) -> None:
        for fd, offset, length in self._chunk_segments(chunk):
            punch_hole(fd, offset, length)

    def release_empty_chunks(self) -> int:
        """Give every chunk with no page back to the budget (and its blocks to the disk)."""
        with self._lock:
            return self._slots.release_empty()

    def free(self, slot: int) -> None:
        """Let a slot go; it is handed out again once flush_freed() has zeroed its header."""
        with self._lock:
            assert slot not in self._freed, f"double free of disk slot {slot}"
            self._freed.append(slot)

    @property
    def num_freed(self) -> int:
        """Freed slots waiting for flush_freed()."""
        return len(self._freed)

    def flush_freed(self) -> int:
        """Zero the headers of the freed slots (a page there no longer comes back from scan()),
        then hand the slots out again; returns how many. A header that cannot be written is
        logged: its slot is still handed out (the next page written there replaces it)."""
        with self._lock:
            freed, self._freed = self._freed, []
        if not freed:
            return 0
        assert not self._closed, "disk arena is closed"
        errors = [error for error in self._run(self._zero_one, [(slot,) for slot in freed])
                  if error is not None]
        if self._sync({self._locate(slot)[0] for slot in freed}):  # durable: a discarded
            with self._lock:  # page stays gone through a power cut, before its slot is reused
                self.num_syncs += 1
        self._count(written_bytes=HEADER_BYTES * (len(freed) - len(errors)))
        if errors:
            logger.warning("disk tier in %s: zeroing the headers of %d freed slots failed "
                           "(their pages may come back after a restart): %s", self.dir_path,
                           len(errors), errors[0])
        with self._lock:
            for slot in freed:
                self._slots.free(slot)
        return len(freed)

    def _zero_one(self, slot: int) -> OSError | None:
        fd, offset = self._locate(slot)
        try:
            if self.faults is not None:
                self.faults.before_io(writing=True)
            pwritev_all(fd, [self._zero_header], offset)
            return None
        except OSError as error:
            return error

    @property
    def slots(self) -> ChunkedSlots:
        """The chunked slot space (its chunks are held against the disk budget)."""
        return self._slots

    @property
    def num_used(self) -> int:
        """Slots holding a page (freed ones waiting for flush_freed() are not)."""
        return self._slots.num_used - len(self._freed)

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def _count(self, read_bytes: int = 0, written_bytes: int = 0,
               checksum_failures: int = 0) -> None:
        with self._lock:
            self.bytes_read += read_bytes
            self.bytes_written += written_bytes
            self.checksum_failures += checksum_failures

    def _run(self, func: Callable, args_list: list[tuple]) -> list:
        """func(*args) for each args: inline for one, across the thread pool for more. Every
        one has finished before this returns or raises (the first error): a batch whose
        write failed frees its slots, which must not be handed out while a sibling's write
        to one of them is still on its way (it would land on the next page there)."""
        assert not self._closed, "disk arena is closed"
        if len(args_list) <= 1:
            return [func(*args) for args in args_list]
        futures = [self._executor.submit(func, *args) for args in args_list]
        wait(futures)
        return [future.result() for future in futures]

    def close(self) -> None:
        """Zero the freed slots' headers, wait for in-flight I/O, fsync and close the slab
        files. Idempotent."""
        if self._closed:
            return
        self.flush_freed()
        self._closed = True
        self._executor.shutdown(wait=True)
        fds, self._fds = self._fds, []
        try:
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def __enter__(self) -> DiskArena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
