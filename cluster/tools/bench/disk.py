"""The disk tier itself next to fio, for `raykv bench tiers`: DiskArena.write_pages and
read_pages (what demotion and promotion run) against fio O_DIRECT psync at the same block
size, with numjobs = the arena's threads (CacheConfig.disk_threads: each thread, like each fio
job, has one pread/pwrite in flight), interleaved in rotating rounds, on files in the same
directory (a real disk).

The arena writes each page with the checksum the node took when the page came into its host
tier (cluster/core/checksums_ahead.py), as demotion does: the write only writes. That hash
is the node's work between requests, not the write's; its time per batch is reported beside
(phases_ms.arena_checksum, one thread). Reads verify every page's checksum, as promotion does.

Writes run twice: in the volatile mode against plain fio randwrite (disk_write_vs_raw), and
in the durable mode (one fdatasync per batch of num_pages pages before write_pages returns)
against fio randwrite with --fdatasync=num_pages (each job fdatasyncs after every num_pages of
its writes: as many syncs per byte written, without the arena's wait for the batch's last
write), the limit of durable writes at that block size and queue depth
(durable_write_vs_raw).

Plain writers of the same pages (rawwrite.py), in the same rounds, take the write's ratio
apart: raw_hot_write rewrites one page per thread as fio's jobs do, raw_write goes through the
batch's pages as demotion does; both free-running on as many threads, from the buffers the
arena writes from.

End to end (e2e_contenders, run in the same rounds): the service with its host tier full, a
put that demotes a batch to disk and a get that reads one up, each required to have moved a
batch's bytes through the disk tier (the node's disk_bytes_written / disk_bytes_read)."""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import time
from collections.abc import Callable

import numpy as np

from cluster.core.config import CacheConfig
from cluster.core.tiers.disk_format import checksum
from cluster.tools.bench import common, harness, peers
from cluster.tools.bench.rawwrite import RawWriter

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
        # Taken when each page came in (checksums_ahead.py), as the pages demotion writes have.
        self.checksums = [checksum(payload) for payload in self.payloads]
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
        """Median ms to checksum one batch's pages in one thread, as the node does per page
        when it comes in (and a read, to verify it)."""
        def checksums() -> None:
            for payload in self.payloads:
                checksum(payload)

        return common.warm_median_s(checksums, DISK_REPS) * 1e3

    def write_batch(self, _: int = 0) -> None:
        """One batch at random slots (noted for the reads)."""
        slots = self.rng.choice(self.arena.num_slots, self.num_pages, replace=False).tolist()
        self.arena.write_pages([(s, k, 0, p) for s, k, p in
                                zip(slots, self.keys, self.payloads, strict=True)],
                               checksums=self.checksums)
        self.written.append(slots)

    def write_gbps(self, durability: str = "volatile") -> float:
        """Write batches in that durability mode (cluster/core/tiers/disk.py's
        set_durability)."""
        self.arena.set_durability(durability)
        self.written = []
        return self._timed_batches(self.write_batch)

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


def measure_disk(disk_dir: str, page_bytes: int, num_pages: int, num_rounds: int,
                 extra: dict[str, Callable[[int], float]] | None = None) -> dict[str, list[float]]:
    """GB/s per round of each contender, in disk_dir, every round in rotating order
    (harness.interleave): fio randwrite and the arena's (volatile) write; fio randwrite with an
    fdatasync every num_pages writes of each job and the arena's durable write (an fdatasync
    per batch of num_pages pages: as many syncs per byte); fio randread and the arena's read;
    the plain writers of the arena's pages (raw_hot_write, raw_write: rawwrite.py); and
    `extra`'s contenders. Then "arena_checksum_ms" once."""
    from cluster.core.tiers.disk import DiskArena

    threads = CacheConfig().disk_threads  # the service's disk tier runs as many
    fio_bytes = DISK_FILE_BYTES // page_bytes * page_bytes

    def fio(rw: str, sync_every: int = 0) -> Callable[[int], float]:
        return lambda _: peers.fio_gbps(disk_dir, rw, page_bytes, threads, fio_bytes, sync_every)

    arena_dir = os.path.join(disk_dir, "arena")
    with DiskArena(arena_dir, DISK_FILE_BYTES, page_bytes, threads) as arena:
        if not arena.direct_io:
            raise RuntimeError(f"O_DIRECT does not work in {disk_dir}")
        bench = ArenaBench(arena, page_bytes, num_pages)
        bench.write_batch()  # something for a read that comes first to read
        with RawWriter(disk_dir, bench.payloads, DISK_FILE_BYTES, threads) as raw:
            raw.warm()
            rounds = _interleave_disk(bench, raw, fio, num_pages, num_rounds, extra)
        rounds["arena_checksum_ms"] = [bench.checksum_ms()]
    shutil.rmtree(arena_dir, ignore_errors=True)
    return rounds


def _interleave_disk(bench: ArenaBench, raw: RawWriter, fio: Callable, num_pages: int,
                     num_rounds: int, extra: dict | None) -> dict[str, list[float]]:
    return harness.interleave({
        "fio_write": fio("write"), "arena_write": lambda _: bench.write_gbps(),
        "fio_durable_write": fio("write", num_pages),
        "arena_durable_write": lambda _: bench.write_gbps("durable"),
        "fio_read": fio("read"), "arena_read": lambda _: bench.read_gbps(),
        "raw_hot_write": lambda index: raw.write_gbps(ARENA_MIN_S, hot=True, seed=index),
        "raw_write": lambda index: raw.write_gbps(ARENA_MIN_S, hot=False, seed=index),
        **(extra or {})}, num_rounds)


# ---- the disk tier end to end, through the service (tiers_session.Session) -----------------


def fill_host(session, num_batches: int) -> bool:
    """Put fresh batches until the disk tier holds num_batches batches: the host tier is then
    full, and each put demotes its least recently used batch (1, 2, ...: tiers reads batch 0
    all along). False if a bounded number of puts did not get there: the batches the host
    tier still has room for, then one batch down a put, and a few spare."""
    wanted_pages = num_batches * session.plan.num_pages
    for _ in range(session.host_room_batches() + num_batches + 5):
        if session.node_stat("pages")["disk"] >= wanted_pages:
            return True
        session.put_batch()
    return session.node_stat("pages")["disk"] >= wanted_pages


def e2e_contenders(session, reps: int) -> dict[str, Callable[[int], float]]:
    """GB/s of "e2e_put": `reps` puts, each of which must demote a batch to disk (timed until
    its commit is answered: a put into leased slots demotes in that background call, which
    also leases the next slots); "e2e_get":
    gets of batches 1, 2, ... (demoted first), each of which must read its batch up from disk,
    checked byte for byte (untimed). A step that left the disk alone marks its figure unmet."""
    batch_bytes = session.plan.batch_bytes
    on_disk = itertools.count(1)

    def moved_s(figure: str, moved: Callable[[], int], run: Callable[[], float],
                why: str) -> float:
        before = moved()
        seconds = statistics.median(run() for _ in range(reps))
        session.expect(figure, moved() - before >= reps * batch_bytes, why)
        return seconds

    return {"e2e_put": lambda _: batch_bytes / 1e9 / moved_s(
                "e2e_put", lambda: session.node_stat("disk_bytes_written"),
                lambda: common.timed(session.put_settled)[0],
                "an e2e put did not demote a batch to disk"),
            "e2e_get": lambda _: batch_bytes / 1e9 / moved_s(
                "e2e_get", session.disk_bytes_read, lambda: session.check_batch(next(on_disk)),
                "an e2e get did not read its batch from disk")}
