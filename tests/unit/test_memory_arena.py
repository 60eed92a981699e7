"""Shared-memory arenas on their own: slots, generation tables, close, and stale-slab
clean-up by prefix."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.core.tiers.memory import SHM_DIR, ArenaMapping, MappedArena, remove_stale_shm
from tests.unit._pages import shm_files, unique_prefix


def test_mapped_arena_slots_and_close():
    prefix = unique_prefix()
    arena = MappedArena("host", 3 * 4096 + 100, 4096, False, prefix)
    assert arena.num_slots == 3
    assert [arena.alloc() for _ in range(4)] == [0, 1, 2, None]
    assert arena.used_bytes == 3 * 4096
    assert arena.view(2).shape == (4096,) and arena.view(2).dtype == torch.uint8
    assert arena.generation(1) == 0
    arena.free(1)
    assert arena.generation(1) == 1  # bumped by free(), the other slots' stay
    assert [arena.generation(s) for s in (0, 2)] == [0, 0]
    assert arena.alloc() == 1
    assert len(shm_files(prefix)) == 2  # the slab and its generation table
    descriptor = arena.descriptor()
    assert os.path.getsize(descriptor.shm_path) == 3 * 4096
    assert descriptor.generations_path == descriptor.shm_path + "-gen"
    assert os.path.getsize(descriptor.generations_path) == 4096  # 3 uint64, page-rounded
    assert ArenaMapping(descriptor).generation(1) == 1
    arena.close()
    arena.close()  # idempotent
    assert shm_files(prefix) == []
    with pytest.raises(AssertionError):
        MappedArena("host", 4096, 1000, False, prefix)
    empty = MappedArena("device", 0, 4096, False, prefix)
    assert empty.num_slots == 0 and empty.alloc() is None
    assert len(shm_files(prefix)) == 2  # a CPU device stand-in has both files too
    empty.close()
    assert shm_files(prefix) == []


def test_remove_stale_shm_only_removes_its_prefix():
    prefix = unique_prefix()
    stale = os.path.join(SHM_DIR, f"{prefix}-host-abc")
    other = os.path.join(SHM_DIR, f"{prefix}x-host-abc")
    for path in (stale, other):
        with open(path, "wb") as handle:
            handle.write(b"x")
    try:
        assert remove_stale_shm(prefix) == 1
        assert not os.path.exists(stale) and os.path.exists(other)
    finally:
        for path in (stale, other):
            if os.path.exists(path):
                os.unlink(path)
