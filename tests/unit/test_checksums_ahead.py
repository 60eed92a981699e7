"""Checksums taken once, soon after a page comes in (cluster/core/checksums_ahead.py): a page
hashed ahead is demoted with no pass over its bytes, a page read up keeps its verified
checksum, and a checksum that no longer matches its bytes makes a miss, never wrong bytes.
Pure asyncio pools over a real disk directory, no Ray."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import cluster.core.checksums_ahead as checksums_ahead
from cluster.core.background import BACKGROUND_NICE
from cluster.core.geometry import DISK, HOST
from cluster.core.tiers import disk_format
from tests.unit._pages import PAGE_BYTES, key, page, page_bytes
from tests.unit._pool_harness import (
    assert_slots_consistent,
    put,
    put_each,
    read,
    run,
    store_put_each,
    tiers,
)


@pytest.fixture
def payload_hashes(monkeypatch) -> list[int]:
    """The sizes of the page payloads the disk tier hashes to write them, from now on
    (headers not counted; the reads' verification uses its own import)."""
    sizes: list[int] = []
    original = disk_format.checksum

    def counting(data):
        if data.nbytes >= PAGE_BYTES:
            sizes.append(data.nbytes)
        return original(data)

    monkeypatch.setattr(disk_format, "checksum", counting)
    return sizes


def same_page(got: torch.Tensor, i: int) -> bool:
    return got.view(torch.uint8).equal(page(i).view(torch.uint8))


def test_a_page_hashed_ahead_is_demoted_with_no_pass_over_its_bytes(harness, payload_hashes):
    pool = harness.make(device_pages=0, host_pages=4, disk_pages=8, eviction="lru")
    run(put_each(pool, range(4)))
    assert pool.num_unsummed == 4
    assert run(pool.checksum_ahead()) == 4
    assert pool.checksums_ahead == 4 and pool.num_unsummed == 0
    for i in range(4):
        entry = pool.index[key(i)]
        assert entry.checksum == disk_format.checksum(page_bytes(i).numpy())
    payload_hashes.clear()
    run(put(pool, [4, 5]))  # a full host: pages 0 and 1 go down to disk
    assert tiers(pool)["disk"] == [0, 1]
    assert payload_hashes == [] and pool.inline_checksums == 0  # the demotion only wrote
    for i in range(6):  # and every page reads back whole, from disk too
        assert same_page(run(read(pool, [i]))[0], i), f"page {i}"
    assert pool.disk.checksum_failures == 0
    assert_slots_consistent(pool)


def test_a_page_demoted_before_its_turn_is_hashed_as_it_is_written(harness, payload_hashes):
    pool = harness.make(device_pages=0, host_pages=2, disk_pages=8, eviction="lru")
    run(put_each(pool, range(4)))  # no pass of the node's loop in between
    assert tiers(pool)["disk"] == [0, 1]
    assert payload_hashes == [PAGE_BYTES, PAGE_BYTES] and pool.inline_checksums == 2
    assert same_page(run(read(pool, [0]))[0], 0)


def test_a_page_read_up_from_disk_keeps_its_verified_checksum(harness, payload_hashes):
    pool = harness.make(device_pages=0, host_pages=2, disk_pages=8, eviction="lru")
    run(put_each(pool, range(4)))  # 0 and 1 hashed as they went down; 2 and 3 in host
    assert run(pool.checksum_ahead()) == 2
    written = pool.index[key(0)].checksum
    assert written is not None  # the write's checksum stays with the page on disk
    payload_hashes.clear()
    assert same_page(run(read(pool, [0]))[0], 0)  # read up; page 2 goes down for it
    assert tiers(pool) == {"device": [], "host": [0, 3], "disk": [1, 2]}
    assert pool.index[key(0)].checksum == written  # verified by the read
    assert run(pool.checksum_ahead()) == 0  # so nothing is left to hash
    assert same_page(run(read(pool, [3]))[0], 3)  # page 0 is now the coldest in host
    run(put(pool, [4]))  # and goes down again
    assert pool.index[key(0)].tier == DISK
    assert payload_hashes == []  # not one payload hashed for any of these writes
    assert same_page(run(read(pool, [0]))[0], 0)


def test_bytes_changed_after_hashing_read_back_as_a_miss_never_as_wrong_bytes(harness):
    pool = harness.make(device_pages=0, host_pages=2, disk_pages=8, eviction="lru")
    run(put_each(pool, range(2)))
    assert run(pool.checksum_ahead()) == 2
    entry = pool.index[key(0)]
    pool.memory[HOST].view(entry.slot)[:16] = 0xEE  # a stray write after the hash
    run(put(pool, [2, 3]))  # pages 0 and 1 go down with the checksums taken before
    assert tiers(pool)["disk"] == [0, 1]
    assert run(read(pool, [0])) == []  # a miss
    assert pool.disk.checksum_failures == 1
    assert key(0) not in pool.index  # forgotten, as any page that fails its checksum
    assert same_page(run(read(pool, [1]))[0], 1)


def test_a_page_that_left_its_slot_while_hashed_gets_no_checksum(harness, monkeypatch):
    pool = harness.make(device_pages=0, host_pages=2, disk_pages=8, eviction="lru")
    run(put_each(pool, range(2)))
    real_hash_thread = checksums_ahead._on_hash_thread

    async def page_0_discarded_then_its_slot_reused(function):
        # On the loop while the hash would run: page 0 is discarded and page 2 takes its slot.
        pool.drop(key(0))
        await put(pool, [2])
        return await real_hash_thread(function)

    monkeypatch.setattr(checksums_ahead, "_on_hash_thread", page_0_discarded_then_its_slot_reused)
    assert run(pool.checksum_ahead()) == 1  # page 1 only
    monkeypatch.undo()
    assert pool.index[key(1)].checksum is not None
    assert pool.index[key(2)].checksum is None and pool.num_unsummed == 1  # page 2 waits
    assert run(pool.checksum_ahead()) == 1
    assert pool.index[key(2)].checksum == disk_format.checksum(page_bytes(2).numpy())


def test_pages_whose_disk_copy_is_encoded_are_not_queued(harness):
    pool = harness.make(device_pages=0, host_pages=2, disk_pages=8, eviction="lru",
                        codec="fp8")
    run(put_each(pool, range(4)))
    assert pool.num_unsummed == 0 and run(pool.checksum_ahead()) == 0
    got = run(read(pool, [0]))[0]  # fp8 on disk: close, not equal
    assert torch.allclose(got, page(0), rtol=0.13, atol=0.05)
    assert pool.index[key(0)].checksum is None  # decoded bytes: not the disk copy's checksum


def test_the_queue_stays_within_twice_the_host_tier_when_puts_outrun_the_passes(harness):
    pool = harness.make(device_pages=0, host_pages=2, disk_pages=200, eviction="lru")
    run(put_each(pool, range(150)))  # no pass at all: 148 pages went down unhashed
    assert pool.num_unsummed <= 2 * 2 + 64 + 1
    assert run(pool.checksum_ahead()) == 2  # the two host pages are still in it
    assert pool.num_unsummed == 0


def test_a_pool_without_disk_queues_nothing(harness):
    pool = harness.make(device_pages=0, host_pages=4, disk_pages=0)
    run(put_each(pool, range(3)))
    assert pool.num_unsummed == 0 and run(pool.checksum_ahead()) == 0


def test_the_store_hashes_every_pool_and_reports_it(stores):
    store = stores.make(device_pages=0, host_pages=4, disk_pages=8)
    run(store_put_each(store, range(3)))
    assert store.stats()["checksum_queued_pages"] == 3
    assert run(store.checksum_ahead()) == 3
    stats = store.stats()
    assert stats["checksums_ahead_pages"] == 3 and stats["checksum_queued_pages"] == 0
    assert stats["inline_checksum_pages"] == 0


def test_the_arena_writes_a_known_checksum_as_given(tmp_path):
    from cluster.core.tiers.aligned import aligned_empty
    from cluster.core.tiers.disk import DiskArena

    arena = DiskArena(tmp_path / "arena", 4 * 8192 + 4 * 4096, 8192, 2)
    try:
        payloads = [aligned_empty(8192) for _ in range(3)]
        for i, payload in enumerate(payloads):
            payload[:] = np.arange(8192, dtype=np.uint64).astype(np.uint8) ^ i
        right = disk_format.checksum(payloads[0])
        slots = [arena.alloc() for _ in range(3)]
        metas = arena.write_pages(
            [(slot, key(i), 0, payloads[i]) for i, slot in enumerate(slots)],
            checksums=[right, 12345, None])  # given right, given wrong, not given
        assert [meta.checksum for meta in metas] == [
            right, 12345, disk_format.checksum(payloads[2])]
        outs = [aligned_empty(8192) for _ in range(3)]
        got = arena.read_pages(slots, outs)
        assert got[0] is not None and np.array_equal(outs[0], payloads[0])
        assert got[1] is None and arena.checksum_failures == 1  # the wrong one: a miss
        assert got[2] is not None and np.array_equal(outs[2], payloads[2])
        with pytest.raises(ValueError, match="checksums"):
            arena.write_pages([(slots[0], key(0), 0, payloads[0])], checksums=[1, 2])
    finally:
        arena.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread nice is Linux's")
def test_pages_are_hashed_at_the_lower_priority_of_work_ahead_of_need():
    """The hash thread yields a core to the copies of requests (background.py)."""
    def own_nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert run(checksums_ahead._on_hash_thread(own_nice)) >= BACKGROUND_NICE
