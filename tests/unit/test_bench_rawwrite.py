"""The plain O_DIRECT writer that takes `bench tiers`' disk_write_vs_raw apart (rawwrite.py):
its writes land whole, its two patterns write what they say, and `measure_disk` runs it."""

import os

import numpy as np
import pytest

from cluster.core.tiers.aligned import aligned_empty
from cluster.tools.bench import disk, rawwrite
from cluster.tools.bench.rawwrite import RawWriter

PAGE_BYTES = 64 << 10


def _pages(num_pages: int) -> list[np.ndarray]:
    return disk._arena_payloads(PAGE_BYTES, num_pages)


def _slots_holding(writer: RawWriter, pages: list[np.ndarray]) -> set[int]:
    """Which payload each slot of the file holds (-1: none of them)."""
    out = aligned_empty(PAGE_BYTES)
    held = set()
    for slot in range(writer.num_slots):
        writer.read_slot(slot, out)
        held.add(next((i for i, page in enumerate(pages) if np.array_equal(out, page)), -1))
    return held


def test_the_writer_warms_every_page_in_and_removes_its_file(tmp_path):
    pages = _pages(4)
    with RawWriter(str(tmp_path), pages, 8 * PAGE_BYTES, num_threads=2) as writer:
        writer.warm()
        path = writer.path
        assert os.path.getsize(path) == 8 * PAGE_BYTES
        out = aligned_empty(PAGE_BYTES)
        for slot, page in enumerate(pages):
            writer.read_slot(slot, out)
            assert np.array_equal(out, page)
    assert not os.path.exists(path)


def test_hot_threads_rewrite_one_page_each_and_the_other_pattern_writes_them_all(tmp_path):
    pages = _pages(8)
    with RawWriter(str(tmp_path), pages, 64 * PAGE_BYTES, num_threads=2) as writer:
        assert writer.write_gbps(0.05, hot=True) > 0
        # two threads, each its own page: only pages 0 and 1 ever land
        assert _slots_holding(writer, pages) <= {-1, 0, 1}
    with RawWriter(str(tmp_path), pages, 64 * PAGE_BYTES, num_threads=2) as writer:
        writer.warm()  # slots 0..7 hold pages 0..7; then the timed writes go everywhere
        assert writer.write_gbps(0.2, hot=False) > 0
        assert _slots_holding(writer, pages) - {-1} == set(range(8))
        assert writer._payload(1, 3, hot=False) is pages[(3 * 2 + 1) % 8]
        assert writer._payload(1, 3, hot=True) is pages[1]


def test_bad_geometry_is_refused_before_any_file_is_made(tmp_path):
    with pytest.raises(ValueError, match="at least one payload"):
        RawWriter(str(tmp_path), [], PAGE_BYTES, 1)
    with pytest.raises(ValueError, match="holds no page"):
        RawWriter(str(tmp_path), _pages(1), PAGE_BYTES // 2, 1)
    with pytest.raises(ValueError, match="same size"):
        RawWriter(str(tmp_path), _pages(1) + [disk._arena_payloads(4096, 1)[0]], PAGE_BYTES, 1)
    assert os.listdir(tmp_path) == []


def test_a_failed_write_reaches_the_caller(tmp_path, monkeypatch):
    def short(fd, data, offset):
        return 0

    with RawWriter(str(tmp_path), _pages(2), 4 * PAGE_BYTES, num_threads=2) as writer:
        monkeypatch.setattr(rawwrite.os, "pwrite", short)
        with pytest.raises(OSError, match="short write"):
            writer.write_gbps(0.05, hot=False)


def test_measure_disk_runs_both_raw_writers_beside_fio_and_the_arena(tmp_path, monkeypatch):
    monkeypatch.setattr(disk.peers, "fio_gbps", lambda *args: 1.0)  # fio itself: not the point
    monkeypatch.setattr(disk, "ARENA_MIN_S", 0.02)
    monkeypatch.setattr(disk, "DISK_REPS", 1)
    monkeypatch.setattr(disk, "DISK_FILE_BYTES", 64 * PAGE_BYTES)
    rounds = disk.measure_disk(str(tmp_path), PAGE_BYTES, 4, 3)
    for name in ("raw_hot_write", "raw_write", "arena_write", "fio_write"):
        assert len(rounds[name]) == 3 and all(gbps > 0 for gbps in rounds[name])
    assert not [name for name in os.listdir(tmp_path) if name.startswith("raykv-raw-write")]
