"""Runs of adjacent disk slots, each read or written with one preadv / pwritev (a mixin of
DiskArena).

    slab file:   | hdr 3 | payload 3 | hdr 4 | payload 4 | hdr 5 | payload 5 |    slots 3, 4, 5
    one preadv:  [hdr 3, out 3, hdr 4, out 4, hdr 5, out 5]    each page into its own buffer

A batch's slots are sorted and cut into runs of consecutive slots within one slab file, and
long runs into about as many even pieces as the arena has threads, so that a batch of N
adjacent pages is a few large I/Os (as fio issues them) spread over the threads, not N small
ones. The pages of a prefix usually sit side by side: a demotion writes its victims into the
slots it allocates together. A page still gets its own header, checksum and verdict: a run
read that comes back short or fails is read again page by page (a page that cannot be read
is a miss, as before), and a write of a run fails as a whole, as a batch's writes did.

Only pages that fill their slot's payload span can join a run (anything shorter leaves a gap
in the file between one page and the next header), and only 4096-aligned buffers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from cluster.core.tiers.aligned import ALIGN_BYTES, aligned_empty, is_aligned, pwritev_all, round_up
from cluster.core.tiers.disk_format import HEADER_BYTES, DiskPageMeta, pack_header, payload_checksum

MAX_RUN_SLOTS = 256  # up to 3 iovecs a page, under Linux's IOV_MAX of 1024
MAX_RUN_BYTES = 16 << 20


def plan_runs(slots: list[int], joins: list[bool], slots_per_file: int, num_pieces: int,
              max_run_slots: int) -> list[list[int]]:
    """Positions in `slots`, grouped into runs of consecutive slots in one file (of
    `slots_per_file` slots each), in slot order. Only positions whose `joins` is True are
    grouped with others; the rest are runs of one. A run is cut into even pieces of at most
    max_run_slots, and of at most ceil(joining slots / num_pieces), so that the pieces can
    go in parallel."""
    joining = sorted((slot, position) for position, slot in enumerate(slots) if joins[position])
    runs: list[list[int]] = [[position] for position, join in enumerate(joins) if not join]
    piece_slots = max(1, min(max_run_slots, -(-len(joining) // max(1, num_pieces))))
    current: list[int] = []
    previous = None
    for slot, position in joining:
        if previous is not None and not (slot == previous + 1
                                         and slot // slots_per_file == previous // slots_per_file):
            runs.extend(_even_pieces(current, piece_slots))
            current = []
        current.append(position)
        previous = slot
    runs.extend(_even_pieces(current, piece_slots))
    return runs


def _even_pieces(run: list[int], max_slots: int) -> list[list[int]]:
    if not run:
        return []
    num_pieces = -(-len(run) // max_slots)
    size, extra = divmod(len(run), num_pieces)
    pieces, start = [], 0
    for index in range(num_pieces):
        stop = start + size + (index < extra)
        pieces.append(run[start:stop])
        start = stop
    return pieces


class DiskRuns:
    """DiskArena's batched I/O over runs of adjacent slots. Uses the arena's geometry
    (_span_bytes, slot_bytes, slots_per_file), _locate, faults, _read_one and _verify."""

    def _max_run_slots(self) -> int:
        return max(1, min(MAX_RUN_SLOTS, MAX_RUN_BYTES // self.slot_bytes))

    def _plan(self, slots: list[int], joins: list[bool]) -> list[list[int]]:
        return plan_runs(slots, joins, self.slots_per_file, self.num_threads,
                         self._max_run_slots())

    def _run_in_place(self, run_one: Callable, runs: list[list[int]],
                      args_of: Callable[[list[int]], tuple]) -> list:
        """run_one(*args_of(run)) for each run of positions, across the arena's threads; each
        run's results put back at its positions (the runs go in slot order, a batch's
        answers in its items' order)."""
        results: list = [None] * sum(len(run) for run in runs)
        for run, run_results in zip(runs, self._run(run_one, [args_of(run) for run in runs]),
                                    strict=True):
            for position, result in zip(run, run_results, strict=True):
                results[position] = result
        return results

    def _reads_whole_span(self, out: np.ndarray) -> bool:
        """True when reading into `out` covers its slot's whole payload span, in place."""
        return is_aligned(out) and min(round_up(out.nbytes), self._span_bytes) == self._span_bytes

    def _writes_whole_span(self, payload: np.ndarray) -> bool:
        return is_aligned(payload) and round_up(payload.nbytes) == self._span_bytes

    def _read_run(self, slots: list[int], outs: list[np.ndarray]
                  ) -> list[tuple[DiskPageMeta | None, int]]:
        """Adjacent slots in one preadv (a single slot: _read_one); see the module docstring."""
        if len(slots) == 1:
            return [self._read_one(slots[0], outs[0])]
        fd, offset = self._locate(slots[0])
        heads = [min(out.nbytes, self._span_bytes) // ALIGN_BYTES * ALIGN_BYTES for out in outs]
        blocks = aligned_empty(len(slots) * 2 * HEADER_BYTES).reshape(len(slots), 2, HEADER_BYTES)
        iovecs = []
        for out, head_bytes, (header, tail) in zip(outs, heads, blocks, strict=True):
            iovecs.append(header)
            if head_bytes:
                iovecs.append(out[:head_bytes])
            if head_bytes < self._span_bytes:
                iovecs.append(tail[: self._span_bytes - head_bytes])
        try:
            if self.faults is not None:
                for _ in slots:
                    self.faults.before_io(writing=False)
            read_bytes = os.preadv(fd, iovecs, offset)
        except OSError:
            read_bytes = 0  # each page again on its own: it logs its error and misses
        results = []
        for index, (slot, out) in enumerate(zip(slots, outs, strict=True)):
            if read_bytes < (index + 1) * self.slot_bytes:  # short (a torn slab): on its own
                results.append(self._read_one(slot, out))
                continue
            header, tail = blocks[index]
            meta = self._verify(header, out, tail, heads[index], complete=True)
            results.append((meta, self.slot_bytes))
        return results

    def _write_run(self, items: list[tuple[int, bytes, int, np.ndarray, str, int | None]]
                   ) -> list[tuple[DiskPageMeta, int]]:
        """Adjacent slots' pages in one pwritev (each checksummed here unless its checksum is
        known); a single one: _write_one. OSError when any of it fails."""
        if len(items) == 1:
            return [self._write_one(*items[0])]
        for _ in items:
            if self.faults is not None:
                self.faults.before_io(writing=True)
        fd, offset = self._locate(items[0][0])
        blocks = aligned_empty(len(items) * 2 * HEADER_BYTES).reshape(len(items), 2, HEADER_BYTES)
        iovecs, metas = [], []
        for (_, key, codec, payload, namespace, known), (header, tail) in zip(items, blocks,
                                                                               strict=True):
            meta = DiskPageMeta(key, payload.nbytes, int(codec),
                                payload_checksum(payload, known), namespace)
            pack_header(header, meta)
            metas.append(meta)
            head_bytes = payload.nbytes // ALIGN_BYTES * ALIGN_BYTES
            iovecs += [header, payload[:head_bytes]] if head_bytes else [header]
            if head_bytes < payload.nbytes:
                tail_bytes = payload.nbytes - head_bytes
                tail[:tail_bytes] = payload[head_bytes:]  # the rest of the block stays zero
                iovecs.append(tail)
        pwritev_all(fd, iovecs, offset)
        return [(meta, self.slot_bytes) for meta in metas]
