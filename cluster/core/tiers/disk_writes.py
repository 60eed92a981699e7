"""Writing a batch of pages to the disk arena's slots (a mixin of DiskArena: disk.py).

    slot:  | header block 4096 | payload, rounded up to 4096 |   (disk_format.py)

Every item is checked before any is written; then the batch goes out in runs of adjacent
slots (disk_runs.py), one pwritev each, across the arena's threads. An aligned payload is
written straight from its buffer; any other is copied into a pooled aligned buffer first.
In durable mode the slab files written are fdatasynced before write_pages returns.
"""

from __future__ import annotations

import logging

import numpy as np

from cluster.core.keys import KEY_BYTES
from cluster.core.tiers.aligned import ALIGN_BYTES, is_aligned, pwritev_all, round_up
from cluster.core.tiers.disk_format import (
    HEADER_BYTES,
    MAX_CODEC,
    DiskPageMeta,
    check_bytes,
    check_namespace,
    pack_header,
    payload_checksum,
)

# One logger for the whole disk tier, named for disk.py, whichever of its modules logs.
logger = logging.getLogger("cluster.core.tiers.disk")


class DiskWrites:
    """DiskArena's writes. Uses the arena's geometry (slot_payload_bytes), buffer pools
    (_small, _staging), lock, _locate, _check_slot, _plan, _run_in_place, _count, _sync, free
    and faults."""

    def write_pages(self, items: list[tuple[int, bytes, int, np.ndarray]],
                    namespaces: list[str] | None = None,
                    checksums: list[int | None] | None = None) -> list[DiskPageMeta]:
        """Write (slot, key, codec, payload) pages, each item's namespace in its header ("" when
        `namespaces` is None); all are validated before any is written. Returns each item's
        DiskPageMeta, in the items' order (whatever order their slots are in). In durable mode the
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
        results = self._run_in_place(self._write_run, runs,
                                     lambda run: ([full[p] for p in run],))
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
