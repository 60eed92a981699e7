"""Reading a batch of pages back from the disk arena's slots (a mixin of DiskArena: disk.py).

A batch goes in runs of adjacent slots (disk_runs.py), one preadv each, across the arena's
threads. An out that starts 4096-aligned is read into directly; any other goes through a
pooled aligned buffer and is copied once it verifies. A page whose header or payload fails
its checksum (or a short read: a torn slab) reads as None, a miss, and is counted in
checksum_failures.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from cluster.core.tiers.aligned import ALIGN_BYTES, is_aligned, round_up
from cluster.core.tiers.disk_format import HEADER_BYTES, DiskPageMeta, check_bytes, parse_header
from cluster.core.tiers.disk_format import checksum as _checksum

# One logger for the whole disk tier, named for disk.py, whichever of its modules logs.
logger = logging.getLogger("cluster.core.tiers.disk")


class DiskReads:
    """DiskArena's reads. Uses the arena's geometry (slot_payload_bytes, _span_bytes), buffer
    pools (_small, _staging), _locate, _check_slot, _plan, _run_in_place, _count and faults."""

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
        results = self._run_in_place(self._read_run, runs, lambda run: (
            [slots[p] for p in run], [outs[p] for p in run]))
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
