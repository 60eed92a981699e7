"""A read-only view of a node's disk arena, for the clients on its node: a get of pages the
node holds on disk reads them from the slab files itself, with no call (cluster/fetch.py).

    node:    DiskArena (disk.py) writes, frees and scans the slots; publishes which page is in
             which slot in its disk-held index (held_index.py, tier DISK rows)
    client:  DiskReader opens the same slab files O_RDONLY (O_DIRECT where it works) and reads
             slots in runs, with the arena's own read path (disk_reads.py, disk_runs.py)

Nothing is locked between the two. A slot the node freed or reused while a client read it is
caught by the page's own header: the caller compares the header's key with the key it wanted
(page keys are content hashes, so a page under the same key has the same bytes), and a torn
read fails the header's or the payload's checksum. Either way that page is a miss, never
another page's bytes.

The geometry comes from the arena's manifest.json; a directory without one, or whose files
cannot be opened (another user's), raises OSError or ValueError: the caller then asks the node.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import wait

from cluster.core import cpu_sets
from cluster.core.tiers.aligned import AlignedBufferPool, direct_reads_work, round_up
from cluster.core.tiers.disk_format import HEADER_BYTES, MANIFEST_NAME
from cluster.core.tiers.disk_reads import DiskReads
from cluster.core.tiers.disk_runs import DiskRuns
from cluster.core.tiers.disk_slots import SlabSlots, open_slabs, slab_path

_O_DIRECT = getattr(os, "O_DIRECT", 0)
READER_THREADS = 4  # the default; a client passes its node's disk_threads (store.descriptors)


class DiskReader(DiskReads, DiskRuns, SlabSlots):
    """read_pages(slots, outs) over the slab files of the arena in `dir_path` (see the module
    docstring); thread-safe. `faults` is always None here (the node's arena has the hooks)."""

    def __init__(self, dir_path: str, num_threads: int = READER_THREADS) -> None:
        self.dir_path = dir_path
        with open(os.path.join(dir_path, MANIFEST_NAME)) as file:
            geometry = json.load(file)
        if geometry.get("format") != "raykv-disk-slabs" or \
                geometry.get("header_bytes") != HEADER_BYTES:
            raise ValueError(f"{dir_path} holds no disk arena this reader knows: {geometry}")
        self.slot_payload_bytes = int(geometry["slot_payload_bytes"])
        self._span_bytes = round_up(self.slot_payload_bytes)
        self.slot_bytes = int(geometry["slot_bytes"])
        self.num_slots = int(geometry["num_slots"])
        self.slots_per_file = int(geometry["slots_per_file"])
        self.num_threads = num_threads
        self.faults = None
        self.bytes_read = 0
        self.checksum_failures = 0
        self._lock = threading.Lock()
        self._fds = open_slabs(int(geometry["num_files"]),
                               lambda index: self._open_slab(slab_path(dir_path, index)))
        self._small = AlignedBufferPool(2 * HEADER_BYTES, max_buffers=2 * num_threads)
        self._staging = AlignedBufferPool(self._span_bytes, max_buffers=2 * num_threads)
        self._executor = cpu_sets.thread_pool(num_threads, "raykv-disk-read")
        self._closed = False

    @staticmethod
    def _open_slab(path: str) -> int:
        flags = os.O_RDONLY | os.O_CLOEXEC
        if _O_DIRECT:
            try:
                fd = os.open(path, flags | _O_DIRECT)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    if direct_reads_work(fd):
                        return fd
                except OSError:
                    pass
                os.close(fd)
        return os.open(path, flags)  # buffered, as the arena falls back on such a filesystem

    def _count(self, read_bytes: int = 0, written_bytes: int = 0,
               checksum_failures: int = 0) -> None:
        with self._lock:
            self.bytes_read += read_bytes
            self.checksum_failures += checksum_failures

    def _run(self, func: Callable, args_list: list[tuple]) -> list:
        """func(*args) for each args: inline for one, across the reader's threads for more.
        Every one has finished before this returns or raises (the first error), as the
        arena's own (DiskArena._run): a caller that gives its buffers back on an error must
        not have a sibling read still landing in one."""
        if self._closed:
            raise OSError("the disk reader is closed")
        if len(args_list) <= 1:
            return [func(*args) for args in args_list]
        futures = [self._executor.submit(func, *args) for args in args_list]
        wait(futures)
        return [future.result() for future in futures]

    def close(self) -> None:
        """Close the slab files; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
