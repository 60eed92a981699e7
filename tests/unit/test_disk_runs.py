"""Runs of adjacent disk slots (cluster/core/tiers/disk_runs.py): the plan, and batches read
and written as one preadv / pwritev per run, page by page exact, a bad page a miss alone."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cluster.core.faults import DiskFaults
from cluster.core.tiers.aligned import aligned_empty
from cluster.core.tiers.disk import HEADER_BYTES, DiskArena
from cluster.core.tiers.disk_runs import plan_runs
from tests.unit.test_disk import disk_dir  # noqa: F401  (the fixture)

PAYLOAD_BYTES = 9000  # a slot's payload span is 12288: a full page's last block is partial
SLOT_BYTES = HEADER_BYTES + 12288


def test_plan_groups_adjacent_slots_in_order_within_a_file():
    slots = [5, 3, 4, 9, 10, 0, 11, 12]
    runs = plan_runs(slots, [True] * 8, slots_per_file=11, num_pieces=1, max_run_slots=99)
    assert runs == [[5], [1, 2, 0], [3, 4], [6, 7]]
    assert [[slots[p] for p in run] for run in runs] == [[0], [3, 4, 5], [9, 10], [11, 12]]


def test_plan_keeps_out_what_cannot_join_and_cuts_even_pieces():
    slots = list(range(10))
    joins = [position != 4 for position in range(10)]
    runs = plan_runs(slots, joins, slots_per_file=100, num_pieces=4, max_run_slots=99)
    assert runs == [[4], [0, 1], [2, 3], [5, 6, 7], [8, 9]]  # 9 joining: pieces of <= 3
    assert plan_runs(list(range(7)), [True] * 7, 100, 1, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan_runs([], [], 100, 4, 8) == []


def _payload(seed: int) -> np.ndarray:
    payload = aligned_empty(PAYLOAD_BYTES)
    payload[:] = np.random.default_rng(seed).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)
    return payload


class _Counting:
    """os.preadv / os.pwritev, counted."""

    def __init__(self, monkeypatch) -> None:
        self.calls = {"preadv": 0, "pwritev": 0}
        for name in self.calls:
            real = getattr(os, name)

            def counted(*args, _real=real, _name=name):
                self.calls[_name] += 1
                return _real(*args)
            monkeypatch.setattr(os, name, counted)


def _written(arena: DiskArena, num_pages: int) -> list[tuple[int, bytes, int, np.ndarray]]:
    items = [(arena.alloc(), bytes([i]) * 16, 0, _payload(i)) for i in range(num_pages)]
    arena.write_pages(items[::-1])  # any order: the runs are in slot order
    return items


def test_adjacent_pages_go_in_one_io_per_piece_and_round_trip(disk_dir, monkeypatch):  # noqa: F811
    with DiskArena(disk_dir, 16 * SLOT_BYTES, PAYLOAD_BYTES, num_threads=2) as arena:
        counting = _Counting(monkeypatch)
        items = _written(arena, 12)
        assert counting.calls["pwritev"] == 2  # 12 adjacent slots, 2 threads: 2 pieces of 6
        outs = [aligned_empty(PAYLOAD_BYTES) for _ in items]
        metas = arena.read_pages([slot for slot, *_ in items], outs)
        assert counting.calls["preadv"] == 2
        assert [meta.key for meta in metas] == [key for _, key, _, _ in items]
        for out, (*_, payload) in zip(outs, items, strict=True):
            assert out.tobytes() == payload.tobytes()
        assert (arena.bytes_read, arena.checksum_failures) == (12 * SLOT_BYTES, 0)


def test_a_corrupt_page_in_a_run_is_a_miss_alone(disk_dir):  # noqa: F811
    with DiskArena(disk_dir, 8 * SLOT_BYTES, PAYLOAD_BYTES, num_threads=1) as arena:
        items = _written(arena, 6)
        bad = items[3][0]
        with open(os.path.join(disk_dir, "slab-00000.bin"), "r+b") as slab:
            slab.seek(bad * SLOT_BYTES + HEADER_BYTES + 8500)  # in the page's partial block
            slab.write(b"\xff\x00")
        outs = [aligned_empty(PAYLOAD_BYTES) for _ in items]
        metas = arena.read_pages([slot for slot, *_ in items], outs)
        assert [meta is None for meta in metas] == [i == 3 for i in range(6)]
        assert arena.checksum_failures == 1
        for index, (out, (*_, payload)) in enumerate(zip(outs, items, strict=True)):
            assert index == 3 or out.tobytes() == payload.tobytes()


def test_a_run_torn_by_a_short_slab_reads_its_whole_pages(disk_dir):  # noqa: F811
    with DiskArena(disk_dir, 8 * SLOT_BYTES, PAYLOAD_BYTES, num_threads=1) as arena:
        items = _written(arena, 6)
        slots = [slot for slot, *_ in items]
        os.truncate(os.path.join(disk_dir, "slab-00000.bin"), 4 * SLOT_BYTES + 5000)
        outs = [aligned_empty(PAYLOAD_BYTES) for _ in items]
        metas = arena.read_pages(slots, outs)
        assert [meta is not None for meta in metas] == [slot < 4 for slot in slots]
        assert arena.checksum_failures == 2


def test_a_failing_write_of_a_run_raises(disk_dir):  # noqa: F811
    with DiskArena(disk_dir, 8 * SLOT_BYTES, PAYLOAD_BYTES, num_threads=1) as arena:
        arena.faults = DiskFaults(write_errno=28)
        items = [(arena.alloc(), bytes([i]) * 16, 0, _payload(i)) for i in range(4)]
        with pytest.raises(OSError):
            arena.write_pages(items)
        assert arena.bytes_written == 0


def test_a_write_answers_in_the_items_order_whatever_order_the_slots_are_in(disk_dir):  # noqa: F811
    # The runs go in slot order, and a page that cannot join (a short one) goes on its own:
    # each meta must still be its own item's, as the pool zips them with its entries.
    with DiskArena(disk_dir, 16 * SLOT_BYTES, PAYLOAD_BYTES, num_threads=2) as arena:
        short = aligned_empty(100)
        short[:] = 7
        items = [(slot, bytes([index]) * 16, 0, _payload(index) if slot != 2 else short)
                 for index, slot in enumerate([9, 3, 4, 2, 0, 8])]
        metas = arena.write_pages(items,
                                  checksums=[1000 + index for index in range(len(items))])
        assert [meta.key for meta in metas] == [key for _, key, _, _ in items]
        assert [meta.checksum for meta in metas] == [1000 + index for index in range(6)]
        assert [meta.payload_bytes for meta in metas] == [p.nbytes for *_, p in items]
