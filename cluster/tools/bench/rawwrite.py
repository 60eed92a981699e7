"""A plain O_DIRECT page writer, for `raykv bench tiers`: the disk tier's writes with none of
raykv's code, to take `disk_write_vs_raw` (the disk tier against fio) apart.

    fio randwrite        each job rewrites its one buffer of a page, over and over
    raw_hot_write        the same pattern, from Python threads (this module, hot=True)
    raw_write            each write a different page of the batch, as demotion writes them
    arena_write          DiskArena.write_pages (disk.py's ArenaBench), batch after batch

Both raw writers run `num_threads` free-running threads (fio's numjobs: one pwrite in flight
each, never waiting for each other), each writing whole pages at random page-aligned offsets
of a fallocated file, for at least `min_s`. They write from the payload buffers the disk tier
writes from, so that only the pattern differs.

Why the pattern: on a VM whose virtual disk copies each write out of the guest's memory (this
machine's: a Firecracker guest, virtio-blk), a write's speed depends on where its bytes come
from. fio's few buffers stay hot in the caches; demotion's pages are all different (a batch
here is 64 MiB, twice the L3). raw_write against raw_hot_write measures that difference on the
machine at hand; arena_write against raw_write is what raykv's own code costs.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from cluster.core.tiers.aligned import allocate_range, open_private

_DIRECT_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0) | os.O_CLOEXEC


class RawWriter:
    """Whole-page O_DIRECT writes into a file of `file_bytes` in `dir_path` (created and
    fallocated here; removed by close). `payloads`: 4096-aligned buffers of one page each."""

    def __init__(self, dir_path: str, payloads: list[np.ndarray], file_bytes: int,
                 num_threads: int) -> None:
        if not payloads:
            raise ValueError("RawWriter needs at least one payload")
        self.page_bytes = payloads[0].nbytes
        if any(payload.nbytes != self.page_bytes for payload in payloads):
            raise ValueError("every payload must be one page of the same size")
        self.num_slots = file_bytes // self.page_bytes
        if self.num_slots < 1 or num_threads < 1:
            raise ValueError(f"a file of {file_bytes} bytes holds no page of "
                             f"{self.page_bytes}, or num_threads {num_threads} < 1")
        self.payloads, self.num_threads = payloads, num_threads
        self.path = os.path.join(dir_path, f"raykv-raw-write-{os.getpid()}-{id(self)}.dat")
        self.fd = open_private(self.path, _DIRECT_FLAGS)
        allocate_range(self.fd, 0, self.num_slots * self.page_bytes)

    def warm(self) -> None:
        """Write each payload once, into slots 0, 1, ... (untimed: the file's first writes)."""
        for slot, payload in enumerate(self.payloads[: self.num_slots]):
            os.pwrite(self.fd, payload, slot * self.page_bytes)

    def _payload(self, thread: int, count: int, hot: bool) -> np.ndarray:
        if hot:  # fio's pattern: one buffer per job
            return self.payloads[thread % len(self.payloads)]
        return self.payloads[(count * self.num_threads + thread) % len(self.payloads)]

    def write_gbps(self, min_s: float, hot: bool, seed: int = 0) -> float:
        """GB/s of free-running threads for at least min_s (each finishes its write in
        flight); hot: each thread rewrites its own payload, else they go through all of
        them in turn."""
        stop_s = time.perf_counter() + min_s
        counts = [0] * self.num_threads
        errors: list[BaseException] = []

        def writer(thread: int) -> None:
            rng = np.random.default_rng(seed * self.num_threads + thread)
            try:
                while time.perf_counter() < stop_s:
                    offset = int(rng.integers(self.num_slots)) * self.page_bytes
                    written = os.pwrite(self.fd, self._payload(thread, counts[thread], hot),
                                        offset)
                    if written != self.page_bytes:
                        raise OSError(f"short write: {written} of {self.page_bytes} bytes")
                    counts[thread] += 1
            except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller
                errors.append(error)

        start_s = time.perf_counter()
        threads = [threading.Thread(target=writer, args=(i,), daemon=True)
                   for i in range(self.num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed_s = time.perf_counter() - start_s
        if errors:
            raise errors[0]
        return sum(counts) * self.page_bytes / elapsed_s / 1e9

    def read_slot(self, slot: int, out: np.ndarray) -> None:
        """Read one page back (tests)."""
        os.preadv(self.fd, [out], slot * self.page_bytes)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            os.remove(self.path)

    def __enter__(self) -> RawWriter:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
