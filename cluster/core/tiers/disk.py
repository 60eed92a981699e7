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
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from cluster.core.faults import DiskFaults
from cluster.core.keys import KEY_BYTES
from cluster.core.tiers.aligned import (
    ALIGN_BYTES,
    AlignedBufferPool,
    aligned_empty,
    allocate_range,
    direct_reads_work,
    is_aligned,
    make_private_dir,
    open_private,
    punch_hole,
    pwritev_all,
    round_up,
)
from cluster.core.tiers.chunks import ChunkedSlots, Share
from cluster.core.tiers.disk_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_CODEC,
    DiskPageMeta,
    check_bytes,
    check_namespace,
    ensure_manifest,
    pack_header,
    parse_header,
    payload_checksum,
)
from cluster.core.tiers.disk_format import checksum as _checksum
from cluster.core.tiers.disk_runs import DiskRuns

logger = logging.getLogger(__name__)

MAX_SLAB_FILE_BYTES = 1 << 30
SCAN_CHUNK_SLOTS = 64
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


class DiskArena(DiskRuns):
    """Fixed-size page slots in slab files under `dir_path`, addressed by slot id.

    Thread-safe: alloc/free and the counters take a lock, and batches may run concurrently
    as long as no two of them touch the same slot. A batch's adjacent slots go in runs, one
    preadv / pwritev each (disk_runs.py).
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
        fds: list[int] = []
        try:
            for index in range(self.num_files):
                fds.append(self._open_slab(index))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _open_slab(self, index: int) -> int:
        path = os.path.join(self.dir_path, f"slab-{index:05d}.bin")
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

    def _locate(self, slot: int) -> tuple[int, int]:
        file_index, index_in_file = divmod(slot, self.slots_per_file)
        return self._fds[file_index], index_in_file * self.slot_bytes

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

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} is not in [0, {self.num_slots})")

    def _run(self, func: Callable, args_list: list[tuple]) -> list:
        """func(*args) for each args: inline for one, across the thread pool for more."""
        assert not self._closed, "disk arena is closed"
        if len(args_list) <= 1:
            return [func(*args) for args in args_list]
        return list(self._executor.map(lambda args: func(*args), args_list))

    def write_pages(self, items: list[tuple[int, bytes, int, np.ndarray]],
                    namespaces: list[str] | None = None,
                    checksums: list[int | None] | None = None) -> list[DiskPageMeta]:
        """Write (slot, key, codec, payload) pages, each item's namespace in its header ("" when
        `namespaces` is None); all are validated before any is written. In durable mode the
        slab files written are fdatasynced before this returns.

        `checksums[i]`, where not None, is item i's payload checksum as its owner computed it
        when the page was copied in (checksums_ahead.py): the write then only writes. A wrong
        one is not checked here; the page fails its checksum when read (a miss, never wrong
        bytes). None: computed here, on the writing thread.

        Raises TypeError/ValueError for a bad item (nothing written) and OSError on I/O failure.
        """
        namespaces = [""] * len(items) if namespaces is None else list(namespaces)
        checksums = [None] * len(items) if checksums is None else list(checksums)
        if not len(namespaces) == len(checksums) == len(items):
            raise ValueError(f"{len(items)} items but {len(namespaces)} namespaces and "
                             f"{len(checksums)} checksums")
        seen: set[int] = set()
        for (slot, key, codec, payload), namespace in zip(items, namespaces, strict=True):
            self._check_write_item(slot, key, codec, payload)
            check_namespace(namespace)
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one write batch")
            seen.add(slot)
        full = [(*item, namespace, known) for item, namespace, known
                in zip(items, namespaces, checksums, strict=True)]
        runs = self._plan([slot for slot, *_ in items],
                          [self._writes_whole_span(payload) for *_, payload in items])
        results = [result for run in self._run(self._write_run, [([full[p] for p in run],)
                                                                 for run in runs])
                   for result in run]
        self._count(written_bytes=sum(written for _, written in results))
        if items:
            synced = self._sync({self._locate(slot)[0] for slot in seen})
            with self._lock:
                self.num_syncs += synced
        return [meta for meta, _ in results]

    def write_or_free(self, items: list[tuple[int, bytes, int, np.ndarray]],
                      namespaces: list[str] | None = None,
                      checksums: list[int | None] | None = None) -> list[DiskPageMeta] | None:
        """write_pages; on an I/O error (a full disk) free the items' slots and return None."""
        try:
            return self.write_pages(items, namespaces, checksums)
        except OSError as error:
            logger.warning("disk tier in %s: writing %d pages failed: %s", self.dir_path,
                           len(items), error)
            for slot, *_ in items:
                self.free(slot)
            return None

    def _check_write_item(self, slot: int, key: bytes, codec: int, payload: np.ndarray) -> None:
        self._check_slot(slot)
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        if not isinstance(codec, (int, np.integer)) or not 0 <= codec <= MAX_CODEC:
            raise ValueError(f"codec must be an int in [0, {MAX_CODEC}], got {codec!r}")
        check_bytes("payload", payload)
        if payload.nbytes > self.slot_payload_bytes:
            raise ValueError(f"payload of {payload.nbytes} bytes exceeds the slot payload of "
                             f"{self.slot_payload_bytes} bytes")

    def _write_one(self, slot: int, key: bytes, codec: int, payload: np.ndarray,
                   namespace: str, known: int | None = None) -> tuple[DiskPageMeta, int]:
        if self.faults is not None:
            self.faults.before_io(writing=True)
        fd, offset = self._locate(slot)
        if is_aligned(payload):
            return self._write_in_place(fd, offset, DiskPageMeta(
                key, payload.nbytes, int(codec), payload_checksum(payload, known), namespace),
                payload)
        num_bytes = payload.nbytes
        with self._staging.borrow() as staging:
            body = staging[: round_up(num_bytes)]
            body[:num_bytes] = payload
            body[num_bytes:] = 0
            meta = DiskPageMeta(key, num_bytes, int(codec),
                                payload_checksum(body[:num_bytes], known), namespace)
            return self._write_in_place(fd, offset, meta, body)

    def _write_in_place(self, fd: int, offset: int, meta: DiskPageMeta,
                        payload: np.ndarray) -> tuple[DiskPageMeta, int]:
        """Header block, then `payload` (`meta` describes its first meta.payload_bytes): whole
        blocks straight from it, then its last partial block padded in a pooled buffer."""
        head_bytes = payload.nbytes // ALIGN_BYTES * ALIGN_BYTES
        tail_bytes = payload.nbytes - head_bytes
        with self._small.borrow() as buffer:
            header, tail = buffer[:HEADER_BYTES], buffer[HEADER_BYTES:]
            pack_header(header, meta)
            iovecs = [header, payload[:head_bytes]] if head_bytes else [header]
            if tail_bytes:
                tail[:tail_bytes] = payload[head_bytes:]
                tail[tail_bytes:] = 0
                iovecs.append(tail)
            return meta, pwritev_all(fd, iovecs, offset)

    def read_pages(self, slots: list[int], outs: list[np.ndarray]) -> list[DiskPageMeta | None]:
        """Fill outs[i][:payload_bytes] with slot i's payload; None for a bad or corrupt page.

        Reads round_up(len(out)) payload bytes at most, so an out sized to the stored payload
        reads no more than needed. An out that starts 4096-aligned is read into directly (its
        contents are then undefined on a miss); any other out is untouched on a miss. An out
        shorter than the stored payload is a miss. Callers should compare meta.key.
        """
        if len(slots) != len(outs):
            raise ValueError(f"{len(slots)} slots but {len(outs)} outs")
        for slot, out in zip(slots, outs, strict=True):
            self._check_slot(slot)
            check_bytes("out", out)
            if not out.flags.writeable:
                raise ValueError("out must be writeable")
        runs = self._plan(slots, [self._reads_whole_span(out) for out in outs])
        results: list = [None] * len(slots)
        for run, run_results in zip(runs, self._run(self._read_run, [
                ([slots[p] for p in run], [outs[p] for p in run]) for run in runs]), strict=True):
            for position, result in zip(run, run_results, strict=True):
                results[position] = result
        self._count(read_bytes=sum(read for _, read in results))
        return [meta for meta, _ in results]

    def _read_one(self, slot: int, out: np.ndarray) -> tuple[DiskPageMeta | None, int]:
        fd, offset = self._locate(slot)
        span_bytes = min(round_up(out.nbytes), self._span_bytes)
        try:
            if self.faults is not None:
                self.faults.before_io(writing=False)
            if is_aligned(out):
                return self._read_in_place(fd, offset, out, span_bytes)
            return self._read_copy(fd, offset, out, span_bytes)
        except OSError as error:
            logger.warning("disk tier: reading slot %d failed: %s", slot, error)
            return None, 0

    def _read_in_place(self, fd: int, offset: int, out: np.ndarray,
                       span_bytes: int) -> tuple[DiskPageMeta | None, int]:
        """preadv into [header block, out's whole blocks, a tail block]; copy the tail only."""
        head_bytes = min(out.nbytes, span_bytes) // ALIGN_BYTES * ALIGN_BYTES
        tail_bytes = span_bytes - head_bytes
        with self._small.borrow() as buffer:
            header, tail = buffer[:HEADER_BYTES], buffer[HEADER_BYTES : HEADER_BYTES + tail_bytes]
            iovecs = [iovec for iovec in (header, out[:head_bytes], tail) if iovec.nbytes]
            read_bytes = os.preadv(fd, iovecs, offset)
            complete = read_bytes == HEADER_BYTES + span_bytes
            return self._verify(header, out, tail, head_bytes, complete), read_bytes

    def _verify(self, header: np.ndarray, out: np.ndarray, tail: np.ndarray, head_bytes: int,
                complete: bool) -> DiskPageMeta | None:
        """The page read as `header`, out[:head_bytes] and `tail` (its last partial block),
        if its header parses and its payload fits `out` and matches its checksum (the tail
        copied into `out` first); else None, counted as a checksum failure unless `out` was
        merely too short."""
        meta = self._parse_header(header) if complete else None
        if meta is None or meta.payload_bytes > out.nbytes:
            self._count(checksum_failures=int(meta is None))  # a short out is no damage
            return None
        if meta.payload_bytes > head_bytes:
            out[head_bytes : meta.payload_bytes] = tail[: meta.payload_bytes - head_bytes]
        if _checksum(out[: meta.payload_bytes]) != meta.checksum:
            self._count(checksum_failures=1)
            return None
        return meta

    def _read_copy(self, fd: int, offset: int, out: np.ndarray,
                   span_bytes: int) -> tuple[DiskPageMeta | None, int]:
        """Read into a pooled aligned buffer, verify, then copy: `out` is untouched on a miss."""
        with self._staging.borrow() as staging:
            meta, read_bytes = self._read_in_place(fd, offset, staging[:span_bytes], span_bytes)
            if meta is not None and meta.payload_bytes <= out.nbytes:
                out[: meta.payload_bytes] = staging[: meta.payload_bytes]
                return meta, read_bytes
        return None, read_bytes

    def _parse_header(self, header: np.ndarray) -> DiskPageMeta | None:
        return parse_header(header, self.slot_payload_bytes)

    def scan(self, progress: Callable[[int, int], None] | None = None
             ) -> list[tuple[int, DiskPageMeta]]:
        """Re-index the slabs after a restart: claim and return every slot that verifies.

        Call once, on a fresh arena, before any alloc(). progress(done_slots, num_slots) is
        called on the calling thread as chunks finish. Corrupt or empty slots stay free.
        """
        assert not self._closed, "disk arena is closed"
        assert self.num_used == 0, "scan() re-indexes a fresh arena; call it before alloc()"
        futures = [self._executor.submit(self._scan_range, start,
                                         min(start + SCAN_CHUNK_SLOTS, self.num_slots))
                   for start in range(0, self.num_slots, SCAN_CHUNK_SLOTS)]
        found: list[tuple[int, DiskPageMeta]] = []
        done_slots = 0
        for future in as_completed(futures):
            pages, num_range_slots, read_bytes = future.result()
            found.extend(pages)
            done_slots += num_range_slots
            self._count(read_bytes=read_bytes)
            if progress is not None:
                progress(done_slots, self.num_slots)
        found.sort(key=lambda page: page[0])
        with self._lock:
            refused = set(self._slots.claim_many([slot for slot, _ in found]))
        if refused:
            logger.warning("disk tier in %s: %d pages found but the disk budget has no room "
                           "for them; they are dropped", self.dir_path, len(refused))
        return [page for page in found if page[0] not in refused]

    def _scan_range(self, start: int, stop: int
                    ) -> tuple[list[tuple[int, DiskPageMeta]], int, int]:
        found: list[tuple[int, DiskPageMeta]] = []
        total_read_bytes = 0
        with self._small.borrow() as buffer, self._staging.borrow() as staging:
            for slot in range(start, stop):
                meta, read_bytes = self._scan_one(slot, buffer[:HEADER_BYTES], staging)
                total_read_bytes += read_bytes
                if meta is not None:
                    found.append((slot, meta))
        return found, stop - start, total_read_bytes

    def _scan_one(self, slot: int, header: np.ndarray,
                  staging: np.ndarray) -> tuple[DiskPageMeta | None, int]:
        """A header probe first, so that an empty slot costs one 4096-byte read."""
        fd, offset = self._locate(slot)
        try:
            probe_bytes = os.preadv(fd, [header], offset)
        except OSError as error:
            logger.warning("disk tier: scanning slot %d failed: %s", slot, error)
            return None, 0
        meta = self._parse_header(header) if probe_bytes == HEADER_BYTES else None
        if meta is None:
            return None, probe_bytes
        page, read_bytes = self._read_one(slot, staging[: round_up(meta.payload_bytes)])
        return page, probe_bytes + read_bytes

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
