"""The disk tier itself next to fio, for `raykv bench tiers`: DiskArena.write_pages and
read_pages (what demotion and promotion run) against fio O_DIRECT psync at the same block
size and thread count, interleaved in rounds, on files in the same directory (a real disk).

Writes run twice: in the volatile mode against plain fio randwrite (disk_write_vs_raw), and
in the durable mode (an fdatasync per batch before write_pages returns) against fio
randwrite with --fdatasync=1 (an fdatasync after every write of every job), the limit of
durable writes at that block size and queue depth (durable_write_vs_raw)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable

import numpy as np

from cluster.core.config import CacheConfig
from cluster.tools.bench import common, peers

DISK_REPS = 5  # at least this many batches per disk tier measurement
ARENA_MIN_S = 0.6  # ... and at least this long
DISK_FILE_BYTES = 256 << 20  # fio's file and the disk arena's capacity


def _arena_payloads(page_bytes: int, num_pages: int) -> list[np.ndarray]:
    """peers.page_pool's pages, each in its own 4096-aligned buffer (O_DIRECT wants them)."""
    from cluster.core.tiers.aligned import aligned_empty

    payloads = []
    for page in peers.page_pool(page_bytes, num_pages):
        buffer = aligned_empty(page_bytes)
        buffer[:] = page
        payloads.append(buffer)
    return payloads


class ArenaBench:
    """Batches through a DiskArena for at least ARENA_MIN_S (fio runs FIO_RUNTIME_S):
    writes at random slots, then reads of what was written; GB/s = bytes / time."""

    def __init__(self, arena, page_bytes: int, num_pages: int) -> None:
        from cluster.core.tiers.aligned import aligned_empty

        self.arena, self.num_pages = arena, num_pages
        self.payloads = _arena_payloads(page_bytes, num_pages)
        self.keys = [i.to_bytes(16, "little") for i in range(num_pages)]
        self.outs = [aligned_empty(page_bytes) for _ in range(num_pages)]
        for out in self.outs:
            out.fill(0xA5)
        self.rng = np.random.default_rng(0)
        self.written: list[list[int]] = []
        self.batch_bytes = num_pages * page_bytes

    def _timed_batches(self, run_batch: Callable[[int], object]) -> float:
        """run_batch(i) for i = 0, 1, ... until ARENA_MIN_S and DISK_REPS batches have passed
        (batch 0 is an untimed warm-up); returns GB/s."""
        run_batch(0)
        elapsed_s, count = 0.0, 0
        while elapsed_s < ARENA_MIN_S or count < DISK_REPS:
            count += 1
            start_s = time.perf_counter()
            run_batch(count)
            elapsed_s += time.perf_counter() - start_s
        return count * self.batch_bytes / elapsed_s / 1e9

    def checksum_ms(self) -> float:
        """Median ms to checksum one batch's pages in one thread, as the tier does per page."""
        import xxhash

        def checksums() -> None:
            for payload in self.payloads:
                xxhash.xxh3_64_intdigest(payload)

        return common.warm_median_s(checksums, DISK_REPS) * 1e3

    def write_gbps(self, durability: str = "volatile") -> float:
        """Write batches in that durability mode (disk.py's set_durability)."""
        self.arena.set_durability(durability)

        def write(_: int) -> None:
            slots = self.rng.choice(self.arena.num_slots, self.num_pages, replace=False).tolist()
            self.arena.write_pages([(s, k, 0, p) for s, k, p in
                                    zip(slots, self.keys, self.payloads, strict=True)])
            self.written.append(slots)

        self.written = []
        return self._timed_batches(write)

    def read_gbps(self) -> float:
        """Reads the written batches round robin; checks every page of the last one."""
        metas: list = []

        def read(index: int) -> None:
            metas[:] = self.arena.read_pages(self.written[index % len(self.written)], self.outs)

        gbps = self._timed_batches(read)
        for meta, out in zip(metas, self.outs, strict=True):
            if meta is None or not np.array_equal(
                    out, self.payloads[int.from_bytes(meta.key, "little")]):
                raise RuntimeError("disk tier read back a missing or different page")
        return gbps


def fio_durable_write_gbps(dir_path: str, block_bytes: int, num_jobs: int,
                           size_bytes: int) -> float:
    """fio randwrite as peers.fio_gbps runs it, plus --fdatasync=1 (each job fdatasyncs after
    every write): durable writes at that block size and queue depth (num_jobs)."""
    file_path = os.path.join(dir_path, f"raykv-fio-{uuid.uuid4().hex}.dat")
    argv = peers._fio_argv(file_path, "write", block_bytes, num_jobs, size_bytes)
    try:
        report = peers._run_fio_json([*argv, "--fdatasync=1"])
    finally:
        if os.path.exists(file_path):
            os.remove(file_path)
    return report["jobs"][0]["write"]["bw_bytes"] / 1e9


DISK_ROUND_NAMES = ("fio_write", "arena_write", "fio_durable_write", "arena_durable_write",
                    "fio_read", "arena_read", "arena_checksum_ms")


def measure_disk(disk_dir: str, page_bytes: int, num_pages: int,
                 num_rounds: int) -> dict[str, list[float]]:
    """Per round, in disk_dir: fio write, the arena's (volatile) write, fio durable write, the
    arena's durable write, fio read, the arena's read."""
    from cluster.core.tiers.disk import DiskArena

    threads = CacheConfig().disk_threads
    fio_bytes = DISK_FILE_BYTES // page_bytes * page_bytes
    arena_dir = os.path.join(disk_dir, "arena")
    rounds: dict[str, list[float]] = {n: [] for n in DISK_ROUND_NAMES}
    with DiskArena(arena_dir, DISK_FILE_BYTES, page_bytes, threads) as arena:
        if not arena.direct_io:
            raise RuntimeError(f"O_DIRECT does not work in {disk_dir}")
        bench = ArenaBench(arena, page_bytes, num_pages)
        pairs = (("write", lambda: peers.fio_gbps(disk_dir, "write", page_bytes, threads,
                                                  fio_bytes), bench.write_gbps),
                 ("durable_write", lambda: fio_durable_write_gbps(disk_dir, page_bytes,
                                                                  threads, fio_bytes),
                  lambda: bench.write_gbps("durable")),
                 ("read", lambda: peers.fio_gbps(disk_dir, "read", page_bytes, threads,
                                                 fio_bytes), bench.read_gbps))
        for _ in range(num_rounds):
            for name, fio_gbps, arena_gbps in pairs:
                rounds[f"fio_{name}"].append(fio_gbps())
                rounds[f"arena_{name}"].append(arena_gbps())
            rounds["arena_checksum_ms"].append(bench.checksum_ms())
    shutil.rmtree(arena_dir, ignore_errors=True)
    return rounds
