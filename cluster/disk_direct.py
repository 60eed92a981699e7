"""A get of pages this node holds on disk, with no call: the client reads the node's slab
files itself (cluster/fetch.py, step 1b).

    node:    disk-held index  digest(key) -> (DISK, slot, 0)     tiers/held_index.py
    client:  DiskDirect.located(keys)  the leading run of keys[...] in it -> disk slots
             DiskDirect.read(...)      those slots, in runs (tiers/disk_reader.py), into
                                       pooled aligned staging; each page's header checked
                                       (its key the one wanted, a whole page in a known
                                       codec, its checksum); the leading good pages decoded
                                       if encoded, and copied into `out`

Why: through the node, a get of a disk prefix is a call, the node's read into host slots,
and the client's copy out of them; the read is the same, the call and its hops are not. A
30-page prefix of 128 KiB pages took 9.5 ms through the node on this machine, 3.5 ms here
(docs/benchmarks.md, tiers). The node still hears of the reads (the client's touches) and
moves the pages up as it does for an acquire.

A page that fails any check ends the run: the caller asks the node from there, as it does
when a hint went stale. Pages the node encoded (CacheConfig.disk_codec int8 or fp8) are
decoded here, as the node decodes them on a read-up. Nothing here raises on I/O: a read that
fails is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch

from cluster.core import cpu_sets, quant
from cluster.core.copies import Pair, copy_pages
from cluster.core.geometry import DISK, PageGeometry
from cluster.core.kvcheck import page_rows, slab_order
from cluster.core.tiers.aligned import aligned_empty, round_up
from cluster.core.tiers.disk_reader import READER_THREADS, DiskReader
from cluster.core.tiers.held_index import HeldView
from cluster.core.tiers.slot_table import SLOT, TIER

log = logging.getLogger("raykv.client")
MAX_STAGING = 4  # pooled staging buffers kept (concurrent gets beyond it allocate their own)


class DiskDirect:
    """This client's reads of its node's disk tier for one geometry (see the module
    docstring). Thread-safe."""

    def __init__(self, geometry: PageGeometry, held_path: str, disk_dir: str,
                 max_age_s: float, num_threads: int = READER_THREADS) -> None:
        """`num_threads`: the reads in flight, as many as the node's disk tier keeps."""
        self.geometry = geometry
        self._held = HeldView(held_path, max_age_s)
        try:
            self._reader = DiskReader(disk_dir, num_threads or READER_THREADS)
        except BaseException:
            self._held.close()
            raise
        self._stride = round_up(geometry.page_bytes)  # each page's staging starts aligned
        self._staging: list[np.ndarray] = []
        self._lock = threading.Lock()
        # Reads are started here, so that a get's calls go out while its disk read runs.
        self._starter = cpu_sets.thread_pool(2, "raykv-disk-direct")

    def located(self, keys: list) -> np.ndarray:
        """Disk slots (int64 [N]) of the longest prefix of `keys` the node holds on disk."""
        places = self._held.prefix(keys)
        ends = np.flatnonzero(places[:, TIER] != DISK)
        return places[: ends[0] if ends.size else len(places), SLOT]

    def start(self, keys: list, slots: np.ndarray, out: torch.Tensor,
              first_page: int) -> Future:
        """read(...) in a thread of its own: a future of (pages that arrived whole, seconds
        the read and copy took)."""
        def timed_read() -> tuple[int, float]:
            started_s = time.perf_counter()
            good = self.read(keys, slots, out, first_page)
            return good, time.perf_counter() - started_s

        return self._starter.submit(timed_read)

    def read(self, keys: list, slots: np.ndarray, out: torch.Tensor, first_page: int) -> int:
        """Read the pages of `keys` from `slots` into out's pages first_page..; returns how
        many leading pages arrived whole (the rest of out's pages there are undefined)."""
        count = len(slots)
        staging = self._take(count)
        try:
            pages = [staging[i * self._stride : i * self._stride + self.geometry.page_bytes]
                     for i in range(count)]
            try:
                metas = self._reader.read_pages(slots.tolist(), pages)
            except (OSError, ValueError) as error:  # closed, or slabs gone: a miss
                log.warning("reading this node's disk tier failed (a miss): %s", error)
                return 0
            good = _leading_good(metas, keys, self.geometry)
            if good:
                copy_pages([self._pair(staging, metas[:good], out, first_page)])
            return good
        finally:
            self._give(staging)

    def _pair(self, staging: np.ndarray, metas: list, out: torch.Tensor,
              first_page: int) -> Pair:
        """(out's pages first_page.., the staged pages) as one block for copies.copy_pages;
        pages the node stored encoded (int8, fp8) are decoded first, a stretch at a time."""
        count, shape, dtype = len(metas), self.geometry.shape, self.geometry.torch_dtype()
        rows = torch.from_numpy(np.reshape(staging[: count * self._stride],
                                           (count, self._stride)))
        dst = page_rows(out, shape[3])[:, :, :, first_page : first_page + count]
        if self._stride == self.geometry.page_bytes and all(m.codec == 0 for m in metas):
            return dst, slab_order(rows.view(dtype).view(count, *shape))  # no pass over them
        pages = torch.empty(count, *shape, dtype=dtype)
        for start, stop, codec in _stretches([meta.codec for meta in metas]):
            quant.decode_pages(rows[start:stop], quant.codec_name(codec), shape,
                               pages[start:stop])
        return dst, slab_order(pages)

    def _take(self, count: int) -> np.ndarray:
        nbytes = count * self._stride
        with self._lock:
            for index, buffer in enumerate(self._staging):
                if buffer.nbytes >= nbytes:
                    return self._staging.pop(index)
        return aligned_empty(nbytes)

    def _give(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._staging.append(buffer)
            if len(self._staging) > MAX_STAGING:  # keep the largest
                self._staging.sort(key=lambda staged: staged.nbytes)
                self._staging.pop(0)

    def close(self) -> None:
        self._starter.shutdown(wait=True)
        self._reader.close()
        self._held.close()


def _leading_good(metas: list, keys: list, geometry: PageGeometry) -> int:
    """How many leading pages read back as the very pages wanted: their header's key the
    key asked for, and a whole page in a codec this client knows (raw, int8 or fp8)."""
    for index, (meta, key) in enumerate(zip(metas, keys, strict=True)):
        if meta is None or meta.key != bytes(key) or \
                meta.payload_bytes != _payload_bytes(geometry, meta.codec):
            return index
    return len(metas)


def _payload_bytes(geometry: PageGeometry, codec: int) -> int | None:
    """A whole page's payload in that codec; None for a codec this client does not know."""
    if codec not in quant.CODECS_BY_ID:
        return None
    return quant.payload_bytes(geometry.shape, geometry.torch_dtype(), quant.codec_name(codec))


def _stretches(codecs: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, codec) of each run of equal codecs."""
    stretches, start = [], 0
    for index in range(1, len(codecs) + 1):
        if index == len(codecs) or codecs[index] != codecs[start]:
            stretches.append((start, index, codecs[start]))
            start = index
    return stretches
