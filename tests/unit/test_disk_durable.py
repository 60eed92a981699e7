"""What the disk tier's durability promises rest on (docs/reliability.md, Durability), found
missing by a review: a failed batch waits for every sibling write before its slots are freed;
a discarded page's zeroed header is synced before its slot is reused; pages found by a scan
are synced before they are reported on disk again; the files and directories a tier creates
are durable (their directory is fsynced)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from cluster.core.tiers import aligned, disk
from tests.unit.test_disk import _arena, _key, _payload


@pytest.fixture
def disk_dir(tmp_path):
    return str(tmp_path / "slabs")  # /tmp: the real disk here (O_DIRECT)


def test_a_failed_batch_returns_only_once_every_write_of_it_has_landed(disk_dir):
    """Slot 0's write fails at once while slot 2's is still on its way: the batch's error
    must come after that write, or the freed slot 2 could take a new page that the late
    write then overwrites (a page reported durable, lost)."""
    arena = _arena(disk_dir, num_threads=4)
    landed = threading.Event()

    def write(index: int) -> int:
        if index == 0:
            raise OSError(28, "No space left on device")
        time.sleep(0.3)
        landed.set()
        return index

    try:
        with pytest.raises(OSError):
            arena._run(write, [(index,) for index in range(4)])
        assert landed.is_set()
    finally:
        arena.close()


def fdatasyncs(monkeypatch) -> list[int]:
    synced: list[int] = []
    real = os.fdatasync

    def counted(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    return synced


@pytest.mark.parametrize("mode, syncs", [("durable", True), ("volatile", False)])
def test_zeroed_headers_are_synced_before_their_slots_are_reused(disk_dir, monkeypatch, mode,
                                                                 syncs):
    arena = _arena(disk_dir)
    arena.set_durability(mode)
    try:
        slot = arena.alloc()
        arena.write_pages([(slot, _key(1), 0, _payload(1, 1000))])
        arena.free(slot)
        synced = fdatasyncs(monkeypatch)
        assert arena.flush_freed() == 1
        assert bool(synced) is syncs
    finally:
        arena.close()


def test_pages_found_by_a_scan_are_synced_before_they_are_reported(disk_dir, monkeypatch):
    arena = _arena(disk_dir)
    arena.write_pages([(arena.alloc(), _key(2), 0, _payload(2, 1000))])
    arena.close()
    again = _arena(disk_dir)
    try:
        synced = fdatasyncs(monkeypatch)
        assert len(again.scan()) == 1 and synced
    finally:
        again.close()


def test_the_slab_files_and_a_written_manifest_are_durable_in_their_directory(disk_dir,
                                                                              monkeypatch):
    synced_dirs: list[str] = []
    real = aligned.fsync_dir

    def counted(path: str) -> None:
        synced_dirs.append(os.path.abspath(path))
        real(path)

    monkeypatch.setattr(aligned, "fsync_dir", counted)
    monkeypatch.setattr(disk, "fsync_dir", counted)
    arena = _arena(disk_dir)
    arena.close()
    assert os.path.abspath(disk_dir) in synced_dirs  # its slab files (and its manifest)
    manifest = os.path.join(disk_dir, "x.json")
    aligned.write_private_text(manifest, "{}")
    assert synced_dirs.count(os.path.abspath(disk_dir)) >= 2


def test_fsync_dir_accepts_a_directory_and_refuses_a_file(tmp_path):
    aligned.fsync_dir(str(tmp_path))
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        aligned.fsync_dir(str(tmp_path / "f"))
