"""Shared-memory arenas on their own: slots, generation tables, close, and stale-slab
clean-up by prefix."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.core.tiers.chunks import ChunkedSlots, Share, TierBudget
from cluster.core.tiers.memory import (
    SHM_DIR,
    ArenaMapping,
    ArenaOptions,
    MappedArena,
    remove_stale_shm,
)
from tests.unit._pages import shm_files, unique_prefix


def test_mapped_arena_slots_and_close():
    prefix = unique_prefix()
    arena = MappedArena("host", 3 * 4096 + 100, 4096, ArenaOptions(shm_prefix=prefix))
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
        MappedArena("host", 4096, 1000, ArenaOptions(shm_prefix=prefix))
    empty = MappedArena("device", 0, 4096, ArenaOptions(shm_prefix=prefix))
    assert empty.num_slots == 0 and empty.alloc() is None
    # its generation table and its readers file: chunk files come with grants
    assert len(shm_files(prefix)) == 2
    empty.close()
    empty.close()  # idempotent
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


# ---- one budget per tier, shared in chunks -------------------------------------------------


def test_chunked_slots_grow_in_chunks_within_the_budget():
    budget = TierBudget(4 * 4096)
    slots = ChunkedSlots(8, 4096, Share(budget, "a", 2 * 4096))
    assert (slots.num_chunks, slots.slots_per_chunk, slots.num_free) == (4, 2, 4)
    assert [slots.alloc() for _ in range(5)] == [0, 1, 2, 3, None]
    assert budget.holders == {"a": 4 * 4096} and slots.num_held_chunks == 2
    other = ChunkedSlots(4, 8192, Share(budget, "b", 8192))
    assert other.num_free == 0 and other.alloc() is None  # the budget is spent
    slots.free(2)
    slots.free(3)
    assert slots.chunks_by_use() == [(0, 1), (2, 0)]
    assert slots.release_empty() == 1 and budget.free_bytes == 2 * 4096
    assert other.alloc() == 0 and budget.holders == {"a": 8192, "b": 8192}
    with pytest.raises(AssertionError):
        slots.release(0)  # not empty
    assert slots.claim_many([6, 7]) == [6, 7]  # no budget left for their chunk
    other.free(0)
    other.release_empty()
    assert slots.claim_many([6, 7]) == [] and slots.num_used == 4


def test_a_restart_that_cannot_ready_a_chunk_drops_its_slots_not_the_start():
    """Re-indexing after a restart grants the chunks its pages sit in; a chunk whose memory
    cannot be readied (ENOSPC from the disk tier's fallocate) refused its pages' claim by
    raising, and the node never became ready. Now its slots are refused (misses), the budget
    untouched, and the other chunks' slots are claimed."""
    budget = TierBudget(4 * 4096)
    slots = ChunkedSlots(8, 4096, Share(budget, "a", 2 * 4096))

    def grant(chunk: int) -> None:
        if chunk == 1:
            raise OSError(28, "No space left on device")

    slots.on_grant = grant
    assert slots.claim_many([0, 2, 3, 4]) == [2, 3]
    assert slots.num_used == 2 and budget.holders == {"a": 2 * 2 * 4096}


@pytest.mark.parametrize("error", [RuntimeError("cudaErrorMemoryAllocation: out of memory"),
                                   OSError(12, "Cannot allocate memory"), MemoryError()])
def test_a_chunk_whose_memory_cannot_be_had_is_no_room_not_an_error(error):
    """Readying a chunk's memory can fail after start-up (a GPU an engine filled, a full
    /dev/shm): alloc raised, and the put or promotion that asked failed. Now the chunk is no
    room (None), its budget given back and the failure counted; once the memory is there
    again, the chunk is granted."""
    budget = TierBudget(2 * 4096)
    slots = ChunkedSlots(4, 4096, Share(budget, "a", 2 * 4096))
    failing = [True]

    def grant(chunk: int) -> None:
        if failing[0]:
            raise error

    slots.on_grant = grant
    assert slots.alloc() is None and slots.alloc() is None
    assert budget.used_bytes == 0 and slots.grant_failures == 2
    failing[0] = False
    assert slots.alloc() == 0 and budget.used_bytes == 2 * 4096


def test_without_a_budget_every_slot_is_available():
    slots = ChunkedSlots(5, 4096)
    assert slots.num_free == 5 and [slots.alloc() for _ in range(6)][-1] is None


def allocated_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_arenas_of_two_page_sizes_share_one_budget_and_hand_memory_back():
    prefix = unique_prefix()
    chunk = 64 * 4096
    budget = TierBudget(4 * chunk)
    small = MappedArena("host", 4 * chunk, 4096, ArenaOptions(
        shm_prefix=prefix, share=Share(budget, "small-model", chunk)))
    large = MappedArena("host", 4 * chunk, 4 * 4096, ArenaOptions(
        shm_prefix=prefix, share=Share(budget, "large-model", chunk)))
    path = small.descriptor().shm_path
    assert allocated_bytes(path) == 0  # sparse: nothing held, nothing allocated
    held = [small.alloc() for _ in range(3 * 64)]
    assert None not in held and budget.holders == {"small-model": 3 * chunk}
    assert allocated_bytes(path) >= 3 * chunk  # the chunks were populated when granted
    assert [large.alloc() for _ in range(17)][-1] is None  # one chunk of 16 slots was left
    for slot in held[64:]:
        small.free(slot)
    assert small.slots.release_empty() == 2
    assert allocated_bytes(path) <= chunk  # punched out: the memory went back
    assert large.alloc() is not None and budget.holders["large-model"] == 2 * chunk
    mapping = ArenaMapping(large.descriptor())
    large.view(16).fill_(9)
    assert int(mapping.view(16)[0]) == 9
    small.close()
    large.close()
    assert shm_files(prefix) == []


def test_a_chunk_readied_ahead_is_used_after_the_warm_slots_and_clients_prefault_it():
    prefix = unique_prefix()
    chunk = 4 * 4096
    budget = TierBudget(3 * chunk)
    arena = MappedArena("host", 4 * chunk, 4096, ArenaOptions(
        shm_prefix=prefix, share=Share(budget, "model", chunk)))
    mapping = ArenaMapping(arena.descriptor())
    first = [arena.alloc() for _ in range(2)]
    assert first == [0, 1] and arena.held[0] > 0 and arena.held[1] == 0
    # chunk 0 was faulted in on the first alloc's path (the caller waited): counted
    assert arena.ready_on_path_chunks == 1 and arena.ready_on_path_s > 0
    ahead = arena.slots.take_ahead()  # 2 free slots left: less than a chunk's worth
    assert ahead == 1 and budget.used_bytes == 2 * chunk and arena.slots.take_ahead() is None
    assert arena.held[1] == 0 and mapping.prefault_held() == 1  # only chunk 0 is held
    arena.ready_chunk(ahead)  # off the event loop in the node (asyncio.to_thread)
    arena.slots.open_ahead(ahead)
    assert [arena.alloc() for _ in range(4)] == [2, 3, 4, 5]  # warm slots first, in order
    assert arena.ready_on_path_chunks == 1  # chunk 1 was readied ahead: no caller waited
    assert mapping.prefault_held() == 1 and mapping.prefault_held() == 0
    arena.slots.release_empty()
    for slot in range(6):
        arena.free(slot)
    assert arena.slots.release_empty() == 2 and list(arena.held[:2]) == [0, 0]
    assert arena.slots.take_ahead() == 0  # no free slot held: ready the lowest chunk
    arena.ready_chunk(0)
    arena.slots.open_ahead(0)
    assert mapping.prefault_held() == 1  # a new grant of chunk 0: faulted in again
    arena.close()
    assert shm_files(prefix) == []


def test_a_chunk_taken_ahead_gives_its_bytes_back_when_readying_fails():
    budget = TierBudget(2 * 4096)
    slots = ChunkedSlots(4, 4096, Share(budget, "model", 4096))
    chunk = slots.take_ahead()
    assert chunk == 0 and budget.used_bytes == 4096
    slots.drop_ahead(chunk)
    assert budget.used_bytes == 0 and slots.alloc() == 0
