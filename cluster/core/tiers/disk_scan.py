"""Re-indexing the disk arena's slabs after a restart (a mixin of DiskArena: disk.py).

Each slot's header block is probed first, so an empty slot costs one 4096-byte read; a slot
whose header parses is read whole and verified (disk_reads.py), in ranges of SCAN_CHUNK_SLOTS
across the arena's threads. The slots that verify are claimed; the rest stay free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import as_completed

import numpy as np

from cluster.core.tiers.aligned import round_up
from cluster.core.tiers.disk_format import HEADER_BYTES, DiskPageMeta

# One logger for the whole disk tier, named for disk.py, whichever of its modules logs.
logger = logging.getLogger("cluster.core.tiers.disk")

SCAN_CHUNK_SLOTS = 64


class DiskScan:
    """DiskArena's scan. Uses the arena's slots, buffer pools (_small, _staging), executor,
    _locate, _count, _read_one and _parse_header."""

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
                           "for them, or their space could not be allocated (a full disk); "
                           "they are dropped", self.dir_path, len(refused))
        if found:
            # Durable mode: what a crash left in the page cache, written but never synced, is
            # synced before these pages are reported on disk again.
            self._sync(set(self._fds))
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
