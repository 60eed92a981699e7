"""A client's own reads of its node's disk tier (cluster/disk_direct.py over
cluster/core/tiers/disk_reader.py): the node publishes its disk pages in an index of their
own, the client reads the slab files, and every page that is not the very page wanted (a slot
reused, zeroed or damaged, an encoded page) ends the run, a miss that the get asks for."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from cluster.core import quant
from cluster.core.faults import DiskFaults
from cluster.core.geometry import DISK, HOST
from cluster.core.tiers.aligned import aligned_empty
from cluster.core.tiers.disk import DiskArena, DiskPageMeta
from cluster.core.tiers.disk_format import MANIFEST_NAME
from cluster.core.tiers.disk_reader import DiskReader
from cluster.core.tiers.held_index import HeldView
from cluster.disk_direct import DiskDirect, _leading_good, _stretches
from tests.unit._pages import GEOMETRY, PAGE_BYTES, flip_disk_byte, key, page, page_bytes
from tests.unit._pool_harness import put_each, run, store_put_each, tiers

PAGE_TOKENS = GEOMETRY.shape[3]


@pytest.fixture
def arena(tmp_path):
    disk = DiskArena(tmp_path / "arena", 8 * (PAGE_BYTES + 4096), PAGE_BYTES, 2)
    yield disk
    disk.close()


def write(arena: DiskArena, slots: list[int], ids: list[int]) -> None:
    arena.write_pages([(slot, key(i), 0, page_bytes(i).numpy()) for slot, i in
                       zip(slots, ids, strict=True)])


def read_back(reader: DiskReader, slots: list[int]) -> tuple[list, list[np.ndarray]]:
    outs = [aligned_empty(PAGE_BYTES) for _ in slots]
    return reader.read_pages(slots, outs), outs


def test_reader_reads_what_the_arena_wrote(arena):
    write(arena, [0, 1, 2, 5], [10, 11, 12, 15])  # a run of three, and one alone
    reader = DiskReader(arena.dir_path)
    try:
        metas, outs = read_back(reader, [0, 1, 2, 5])
        assert [meta.key for meta in metas] == [key(i) for i in (10, 11, 12, 15)]
        for out, i in zip(outs, (10, 11, 12, 15), strict=True):
            assert np.array_equal(out, page_bytes(i).numpy())
        assert reader.bytes_read >= 4 * PAGE_BYTES
    finally:
        reader.close()


def test_a_reused_slot_reads_as_the_page_now_there(arena):
    write(arena, [3], [1])
    reader = DiskReader(arena.dir_path)
    try:
        write(arena, [3], [2])  # the node freed and reused the slot meanwhile
        metas, outs = read_back(reader, [3])
        assert metas[0].key == key(2) and np.array_equal(outs[0], page_bytes(2).numpy())
    finally:
        reader.close()


def test_a_freed_slot_is_a_miss_once_its_header_is_zeroed(arena):
    slot = arena.alloc()
    write(arena, [slot], [1])
    arena.free(slot)
    arena.flush_freed()
    reader = DiskReader(arena.dir_path)
    try:
        assert read_back(reader, [slot])[0] == [None]
    finally:
        reader.close()


def test_reader_needs_a_manifest_it_knows(tmp_path, arena):
    with pytest.raises(OSError):
        DiskReader(str(tmp_path))  # no manifest.json here
    with open(os.path.join(arena.dir_path, MANIFEST_NAME), "w") as handle:
        json.dump({"format": "something-else"}, handle)
    with pytest.raises(ValueError, match="no disk arena"):
        DiskReader(arena.dir_path)


def test_a_closed_reader_raises_rather_than_reading(arena):
    write(arena, [0, 1], [1, 2])
    reader = DiskReader(arena.dir_path)
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(OSError):
        read_back(reader, [0, 1])


def test_a_read_that_fails_returns_only_once_its_sibling_reads_landed(arena):
    """The first error is raised once every run has finished: a caller that gives its staging
    buffers back on an error (DiskDirect.read) must not have a sibling read landing in one."""
    reader = DiskReader(arena.dir_path)
    landed = []

    def run(index: int) -> int:
        if index == 0:
            raise OSError("the first run fails at once")
        time.sleep(0.3)
        landed.append(index)
        return index

    with pytest.raises(OSError, match="fails at once"):
        reader._run(run, [(0,), (1,)])
    assert landed == [1]
    reader.close()


# ---- the pool's disk-held index and DiskDirect ---------------------------------------------


def disk_ids(pool) -> list[int]:
    """The ids of the pages on disk, in the order of their slots (as demotion wrote them)."""
    ids = tiers(pool)["disk"]
    return sorted(ids, key=lambda i: pool.index[key(i)].slot)


def direct(pool) -> DiskDirect:
    return DiskDirect(GEOMETRY, pool.disk_held.path, pool.disk.dir_path, 1.0)


def out_pages(out: torch.Tensor, first_page: int, count: int) -> list[torch.Tensor]:
    return [out[:, :, :, p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS]
            for p in range(first_page, first_page + count)]


def test_disk_pages_are_published_and_withdrawn(harness):
    pool = harness.make()
    run(put_each(pool, range(7)))  # 2 on device, 2 on host, 3 on disk
    on_disk = disk_ids(pool)
    assert len(on_disk) == 3
    view = HeldView(pool.disk_held.path, 1.0)
    try:
        places = view.prefix([key(i) for i in on_disk])
        assert places[:, 0].tolist() == [DISK] * 3
        assert places[:, 1].tolist() == [pool.index[key(i)].slot for i in on_disk]
        in_memory = tiers(pool)["host"] + tiers(pool)["device"]
        assert len(view.prefix([key(i) for i in in_memory])) == 0  # those are in the other index
        run(pool.load_from_disk([key(on_disk[0])]))  # read up into host: no longer on disk
        assert pool.index[key(on_disk[0])].tier == HOST
        assert len(view.prefix([key(on_disk[0])])) == 0
    finally:
        view.close()


@pytest.fixture
def on_disk(harness):
    """(pool, ids of its disk pages in slot order, a DiskDirect over it): 7 pages put, 2 on
    device, 2 on host, 3 on disk."""
    pool = harness.make()
    run(put_each(pool, range(7)))
    reader = direct(pool)
    yield pool, disk_ids(pool), reader
    reader.close()


def empty_out(num_pages: int) -> torch.Tensor:
    return torch.zeros(*GEOMETRY.shape[:3], num_pages * PAGE_TOKENS, GEOMETRY.shape[4])


def test_direct_read_copies_the_pages_into_out(on_disk):
    pool, ids, reader = on_disk
    keys = [key(i) for i in ids]
    slots = reader.located(keys)
    assert slots.tolist() == [pool.index[k].slot for k in keys]
    out = empty_out(len(keys) + 1)
    assert reader.read(keys, slots, out, 1) == len(keys)  # after one page of its own
    for got, i in zip(out_pages(out, 1, len(keys)), ids, strict=True):
        assert torch.equal(got, page(i))
    assert (out_pages(out, 0, 1)[0] == 0).all()  # the page before them untouched
    assert reader.start(keys, slots, out, 1).result()[0] == len(keys)


def test_a_page_that_is_not_the_one_wanted_ends_the_run(on_disk):
    pool, ids, reader = on_disk
    keys = [key(i) for i in ids]
    slots = reader.located(keys)
    out = empty_out(len(keys))
    wrong = [keys[0], key(99), keys[2]]  # slot 1 holds another page than the one asked for
    assert reader.read(wrong, slots, out, 0) == 1
    flip_disk_byte(pool.disk.dir_path, int(slots[1]))  # damaged: its checksum fails
    assert reader.read(keys, slots, out, 0) == 1
    assert torch.equal(out_pages(out, 0, 1)[0], page(ids[0]))


def test_only_whole_pages_in_a_known_codec_count():
    fp8_bytes = quant.payload_bytes(GEOMETRY.shape, torch.float32, "fp8")
    raw = DiskPageMeta(key(1), PAGE_BYTES, 0, 0)
    fp8 = DiskPageMeta(key(2), fp8_bytes, 1, 0)
    short = DiskPageMeta(key(2), PAGE_BYTES - 4, 0, 0)
    unknown = DiskPageMeta(key(2), fp8_bytes, 9, 0)  # a codec of a later version
    assert _leading_good([raw, fp8], [key(1), key(2)], GEOMETRY) == 2
    assert _leading_good([raw, short], [key(1), key(2)], GEOMETRY) == 1
    assert _leading_good([raw, unknown], [key(1), key(2)], GEOMETRY) == 1
    assert _leading_good([None, raw], [key(1), key(1)], GEOMETRY) == 0
    assert _stretches([0, 0, 1, 1, 1, 0]) == [(0, 2, 0), (2, 5, 1), (5, 6, 0)]


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_encoded_pages_are_decoded_as_the_node_decodes_them(harness, codec):
    pool = harness.make(codec=codec)
    run(put_each(pool, range(7)))
    ids = disk_ids(pool)
    keys = [key(i) for i in ids]
    assert {pool.index[k].codec for k in keys} == {quant.codec_id(codec)}
    reader = direct(pool)
    try:
        out = empty_out(len(keys))
        assert reader.read(keys, reader.located(keys), out, 0) == len(keys)
        for got, i in zip(out_pages(out, 0, len(keys)), ids, strict=True):
            node_would = quant.decode_page(quant.encode_page(page(i), codec), codec,
                                           GEOMETRY.shape, torch.float32)
            assert torch.equal(got, node_would)
            assert (got - page(i)).norm() / page(i).norm() < 0.1  # and near the page put
    finally:
        reader.close()


def test_a_touch_of_disk_pages_reads_them_up(stores):
    store = stores.make(disk_pages=5)  # 3 of 5 disk slots used: room for host's victims
    run(store_put_each(store, range(7)))
    pool = store.pool(GEOMETRY)
    on_disk = disk_ids(pool)
    before = store.counters["hits_disk"]
    assert run(store.touch(GEOMETRY, [key(i) for i in on_disk])) == len(on_disk)
    assert store.counters["hits_disk"] - before == len(on_disk)
    moved_up = [i for i in on_disk if pool.index[key(i)].tier != DISK]
    assert len(moved_up) == 2  # as many as the host tier holds (2 pages), as an acquire reads
    assert len(pool.index) == 7  # the host pages they replaced went down to disk


def test_a_read_up_drops_no_page_to_make_its_room(stores):
    """A disk with no slot to spare but those being read up: the host's victims have nowhere
    to go, so the pages stay on disk (still read from there) and no page is lost."""
    store = stores.make()  # 3 disk slots, all used
    run(store_put_each(store, range(7)))
    pool = store.pool(GEOMETRY)
    on_disk = disk_ids(pool)
    assert run(store.touch(GEOMETRY, [key(i) for i in on_disk])) == len(on_disk)
    assert len(pool.index) == 7 and disk_ids(pool) == on_disk


def test_injected_disk_faults_send_the_clients_to_the_node(stores):
    """A test's disk faults slow or fail the node's reads: while they are on, the node's disk
    index reads as stale, so clients ask the node for those pages (and meet the faults)."""
    store = stores.make()
    run(store_put_each(store, range(7)))
    pool = store.pool(GEOMETRY)
    view = HeldView(pool.disk_held.path, 1.0)
    try:
        assert view.alive()
        store.set_disk_faults(DiskFaults(delay_s=0.01))
        assert not view.alive()
        store.beat()  # the node's periodic stamp leaves it so
        assert not view.alive()
        store.set_disk_faults(None)
        assert view.alive() and len(view.prefix([key(i) for i in disk_ids(pool)])) == 3
    finally:
        view.close()


def test_the_clients_read_with_as_many_threads_as_the_node(stores):
    store = stores.make()  # disk_threads=2 (the harness's StoreConfig)
    run(store_put_each(store, range(7)))
    found = store.descriptors(GEOMETRY)[0]
    assert found.disk_threads == store.pool(GEOMETRY).disk.num_threads == 2
    reader = DiskDirect(GEOMETRY, found.disk_held_path, found.disk_dir, 1.0, found.disk_threads)
    try:
        assert reader._reader.num_threads == 2
    finally:
        reader.close()
