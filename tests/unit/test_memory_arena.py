"""Shared-memory arenas on their own: slots, close, and stale-slab clean-up by prefix."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.core.tiers.memory import SHM_DIR, MappedArena, remove_stale_shm
from tests.unit._pages import shm_files, unique_prefix


def test_mapped_arena_slots_and_close():
    prefix = unique_prefix()
    arena = MappedArena("host", 3 * 4096 + 100, 4096, False, prefix)
    assert arena.num_slots == 3
    assert [arena.alloc() for _ in range(4)] == [0, 1, 2, None]
    assert arena.used_bytes == 3 * 4096
    assert arena.view(2).shape == (4096,) and arena.view(2).dtype == torch.uint8
    arena.free(1)
    assert arena.alloc() == 1
    assert len(shm_files(prefix)) == 1
    assert os.path.getsize(arena.descriptor().shm_path) == 3 * 4096
    arena.close()
    arena.close()  # idempotent
    assert shm_files(prefix) == []
    with pytest.raises(AssertionError):
        MappedArena("host", 4096, 1000, False, prefix)
    empty = MappedArena("device", 0, 4096, False, prefix)
    assert empty.num_slots == 0 and empty.alloc() is None
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
