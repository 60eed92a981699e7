"""Disk tier: slab files, O_DIRECT, checksums, restart scan. Real disk, tiny sizes, no Ray."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest
import xxhash

from cluster.core.tiers import disk
from cluster.core.tiers.aligned import AlignedBufferPool, aligned_empty, is_aligned, round_up
from cluster.core.tiers.disk import HEADER_BYTES, DiskArena, DiskPageMeta
from cluster.core.tiers.memory import SHM_DIR

SLOT_PAYLOAD_BYTES = 9000
SLOT_BYTES = HEADER_BYTES + 12288  # 9000 rounded up to 4096



def _fs_type(path: str) -> str:
    """Filesystem type of the mount holding `path` (longest mount-point prefix)."""
    path = os.path.realpath(path)
    best_mount, best_type = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, fs_type = line.split()[:3]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best_mount):
                best_mount, best_type = mount, fs_type
    return best_type


def _temp_dir_on(root: str):
    path = tempfile.mkdtemp(prefix="raykv-disk-test-", dir=root)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir(tmp_path):
    """A fresh directory on a real disk (O_DIRECT does not bypass anything on tmpfs)."""
    for root in (str(tmp_path), "/var/tmp", "/tmp"):
        if os.path.isdir(root) and _fs_type(root) not in ("tmpfs", "ramfs", ""):
            yield from _temp_dir_on(root)
            return
    pytest.skip("no real-disk temp directory here")


@pytest.fixture
def shm_dir():
    if not os.path.isdir(SHM_DIR) or _fs_type(SHM_DIR) != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    yield from _temp_dir_on(SHM_DIR)


def _key(index: int) -> bytes:
    return bytes([index % 256]) * 16


def _payload(seed: int, num_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=num_bytes, dtype=np.uint8)


def _misaligned(num_bytes: int, fill: int = 0) -> np.ndarray:
    """A uint8 array guaranteed not to start on a 4096 boundary (forces the copy path)."""
    base = aligned_empty(num_bytes + 1)
    out = base[1:]
    out[:] = fill
    return out


def _meta(key: bytes, codec: int, payload: np.ndarray) -> DiskPageMeta:
    return DiskPageMeta(key, payload.nbytes, codec, xxhash.xxh3_64_intdigest(payload.tobytes()))


def _arena(path: str, num_slots: int = 8, num_threads: int = 4) -> DiskArena:
    return DiskArena(path, num_slots * SLOT_BYTES, SLOT_PAYLOAD_BYTES, num_threads)


def _write(arena: DiskArena, sizes: list[int]) -> list[tuple[int, bytes, int, np.ndarray]]:
    items = [(arena.alloc(), _key(i), i + 1, _payload(i, size)) for i, size in enumerate(sizes)]
    metas = arena.write_pages(items)
    assert metas == [_meta(key, codec, payload) for _, key, codec, payload in items]
    return items


def _flip_byte(path: str, slot: int, offset_in_slot: int) -> None:
    with open(os.path.join(path, "slab-00000.bin"), "r+b") as slab:
        slab.seek(slot * SLOT_BYTES + offset_in_slot)
        value = slab.read(1)[0]
        slab.seek(slot * SLOT_BYTES + offset_in_slot)
        slab.write(bytes([value ^ 0xFF]))


ODD_SIZES = [0, 1, 100, 4095, 4096, 4097, 8191, SLOT_PAYLOAD_BYTES]


def test_geometry_manifest_and_preallocated_slab(disk_dir):
    with DiskArena(disk_dir, 10 * SLOT_BYTES + 5, SLOT_PAYLOAD_BYTES) as arena:
        assert (arena.slot_bytes, arena.num_slots, arena.num_files) == (SLOT_BYTES, 10, 1)
        assert (arena.num_used, arena.num_free) == (0, 10)
    with open(os.path.join(disk_dir, "manifest.json")) as file:
        manifest = json.load(file)
    assert manifest["slot_payload_bytes"] == SLOT_PAYLOAD_BYTES
    assert (manifest["slot_bytes"], manifest["num_slots"]) == (SLOT_BYTES, 10)
    assert sorted(os.listdir(disk_dir)) == ["manifest.json", "slab-00000.bin"]
    assert os.path.getsize(os.path.join(disk_dir, "slab-00000.bin")) == 10 * SLOT_BYTES


def test_direct_io_on_real_disk_without_warning(disk_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arena = _arena(disk_dir)
    assert arena.direct_io is True
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
    arena.close()


def test_round_trip_odd_sizes_byte_exact(disk_dir):
    with _arena(disk_dir) as arena:
        items = _write(arena, ODD_SIZES)
        assert arena.bytes_written == sum(HEADER_BYTES + round_up(n) for n in ODD_SIZES)
        slots = [slot for slot, *_ in items]
        copy_outs = [_misaligned(SLOT_PAYLOAD_BYTES, fill=0xAB) for _ in items]
        metas = arena.read_pages(slots, copy_outs)
        assert metas == [_meta(key, codec, payload) for _, key, codec, payload in items]
        for out, (_, _, _, payload) in zip(copy_outs, items, strict=True):
            assert out[: payload.nbytes].tobytes() == payload.tobytes()
            assert np.all(out[payload.nbytes :] == 0xAB)  # untouched beyond the payload


@pytest.mark.parametrize("padded", [False, True])
def test_read_in_place_into_aligned_outs(disk_dir, padded):
    with _arena(disk_dir) as arena:
        items = _write(arena, ODD_SIZES)
        sizes = [round_up(n) if padded else n for n in ODD_SIZES]
        outs = [aligned_empty(size) for size in sizes]
        metas = arena.read_pages([slot for slot, *_ in items], outs)
        assert metas == [_meta(key, codec, payload) for _, key, codec, payload in items]
        for out, (_, _, _, payload) in zip(outs, items, strict=True):
            assert out[: payload.nbytes].tobytes() == payload.tobytes()
        # an out sized to the payload reads only the payload's blocks
        assert arena.bytes_read == sum(HEADER_BYTES + round_up(n) for n in ODD_SIZES)


def test_aligned_payload_is_written_in_place(disk_dir):
    with _arena(disk_dir) as arena:
        payloads = [aligned_empty(8192), aligned_empty(5000)]
        for seed, payload in enumerate(payloads):
            payload[:] = _payload(seed, payload.nbytes)
        items = [(arena.alloc(), _key(i), 7, p) for i, p in enumerate(payloads)]
        assert arena.write_pages(items) == [_meta(k, 7, p) for _, k, _, p in items]
        outs = [_misaligned(SLOT_PAYLOAD_BYTES) for _ in items]
        assert arena.read_pages([slot for slot, *_ in items], outs) == [
            _meta(k, 7, p) for _, k, _, p in items]
        assert outs[0][:8192].tobytes() == payloads[0].tobytes()
        assert outs[1][:5000].tobytes() == payloads[1].tobytes()


def test_parallel_batch_keeps_order(disk_dir):
    sizes = [int(n) for n in np.random.default_rng(7).integers(1, SLOT_PAYLOAD_BYTES, 32)]
    with _arena(disk_dir, num_slots=40, num_threads=4) as arena:
        items = _write(arena, sizes)
        reversed_items = items[::-1]
        outs = [np.zeros(SLOT_PAYLOAD_BYTES, np.uint8) for _ in reversed_items]
        metas = arena.read_pages([slot for slot, *_ in reversed_items], outs)
        assert metas == [_meta(k, c, p) for _, k, c, p in reversed_items]
        for out, (_, _, _, payload) in zip(outs, reversed_items, strict=True):
            assert out[: payload.nbytes].tobytes() == payload.tobytes()


def test_slots_span_several_slab_files(disk_dir, monkeypatch):
    monkeypatch.setattr(disk, "MAX_SLAB_FILE_BYTES", 3 * SLOT_BYTES)
    with _arena(disk_dir, num_slots=10) as arena:
        assert (arena.slots_per_file, arena.num_files) == (3, 4)
        items = [(slot, _key(slot), 0, _payload(slot, 3000)) for slot in (0, 2, 3, 8, 9)]
        arena.write_pages(items)
        outs = [np.zeros(3000, np.uint8) for _ in items]
        assert arena.read_pages([s for s, *_ in items], outs) == [
            _meta(k, 0, p) for _, k, _, p in items]
        assert all(o.tobytes() == p.tobytes() for o, (*_, p) in zip(outs, items, strict=True))
    sizes = [os.path.getsize(os.path.join(disk_dir, f"slab-{i:05d}.bin")) for i in range(4)]
    assert sizes == [3 * SLOT_BYTES, 3 * SLOT_BYTES, 3 * SLOT_BYTES, SLOT_BYTES]


def test_alloc_free_and_exhaustion(disk_dir):
    with _arena(disk_dir, num_slots=3) as arena:
        slots = [arena.alloc() for _ in range(3)]
        assert sorted(slots) == [0, 1, 2]
        assert arena.alloc() is None
        arena.free(slots[1])  # handed out again only once its header is zeroed
        assert (arena.num_used, arena.num_free, arena.num_freed) == (2, 0, 1)
        assert arena.alloc() is None
        assert arena.flush_freed() == 1
        assert (arena.num_used, arena.num_free, arena.num_freed) == (2, 1, 0)
        assert arena.alloc() == slots[1]


def test_reopen_and_scan_recovers_every_page(disk_dir):
    sizes = [10, 4096, 5000, SLOT_PAYLOAD_BYTES, 1]
    with _arena(disk_dir) as arena:
        items = _write(arena, sizes)
    calls: list[tuple[int, int]] = []
    with _arena(disk_dir) as reopened:
        assert reopened.num_used == 0  # the constructor does not scan
        found = reopened.scan(progress=lambda done, total: calls.append((done, total)))
        assert found == sorted((slot, _meta(k, c, p)) for slot, k, c, p in items)
        assert calls[-1] == (8, 8)
        assert (reopened.num_used, reopened.num_free) == (5, 3)
        # empty slots cost one header read; valid ones a header probe plus a header+payload read
        assert reopened.bytes_read == 8 * HEADER_BYTES + sum(
            HEADER_BYTES + round_up(n) for n in sizes)
        assert reopened.alloc() not in {slot for slot, *_ in items}
        outs = [np.zeros(n, np.uint8) for n in sizes]
        reopened.read_pages([slot for slot, *_ in items], outs)
        assert [o.tobytes() for o in outs] == [p.tobytes() for *_, p in items]


def test_corrupt_payload_byte_is_a_miss_and_dropped_by_scan(disk_dir):
    with _arena(disk_dir) as arena:
        items = _write(arena, [6000, 6000, 6000])
        bad_slot = items[1][0]
        _flip_byte(disk_dir, bad_slot, HEADER_BYTES + 4500)
        slots = [slot for slot, *_ in items]
        for outs in ([np.zeros(6000, np.uint8) for _ in slots],
                     [aligned_empty(8192) for _ in slots]):
            metas = arena.read_pages(slots, outs)
            assert metas == [_meta(*items[0][1:]), None, _meta(*items[2][1:])]
        assert arena.checksum_failures == 2  # once per read of the damaged page
    with _arena(disk_dir) as reopened:
        assert [slot for slot, _ in reopened.scan()] == [slots[0], slots[2]]
        assert (reopened.num_used, reopened.num_free) == (2, 6)


@pytest.mark.parametrize("offset_in_slot", [0, 8, 24, 40])  # magic, key, payload_bytes, sum
def test_corrupt_header_is_a_miss_and_dropped_by_scan(disk_dir, offset_in_slot):
    with _arena(disk_dir) as arena:
        items = _write(arena, [3000, 3000])
        _flip_byte(disk_dir, items[0][0], offset_in_slot)
        outs = [np.zeros(3000, np.uint8) for _ in items]
        assert arena.read_pages([s for s, *_ in items], outs) == [None, _meta(*items[1][1:])]
        assert arena.checksum_failures == 1
    with _arena(disk_dir) as reopened:
        assert [slot for slot, _ in reopened.scan()] == [items[1][0]]


def test_never_written_slot_and_short_out_are_misses(disk_dir):
    with _arena(disk_dir) as arena:
        (slot, *_), = _write(arena, [5000])
        outs = [np.zeros(4999, np.uint8), np.zeros(100, np.uint8)]
        assert arena.read_pages([slot, 7], outs) == [None, None]
        assert arena.checksum_failures == 1  # slot 7 holds no page; a short out is no damage


def test_a_slab_torn_mid_page_counts_checksum_failures(disk_dir):
    with _arena(disk_dir) as arena:
        items = _write(arena, [6000, 6000, 6000])
        slots = [slot for slot, *_ in items]
        os.truncate(os.path.join(disk_dir, "slab-00000.bin"),
                    max(slots[1:]) * SLOT_BYTES + HEADER_BYTES + 3000)
        outs = [np.zeros(6000, np.uint8) for _ in slots]
        metas = arena.read_pages(slots, outs)
        assert metas[0] == _meta(*items[0][1:]) and metas.count(None) >= 1
        assert arena.checksum_failures == metas.count(None)


def test_geometry_mismatch_raises_and_deletes_nothing(disk_dir):
    with _arena(disk_dir) as arena:
        items = _write(arena, [1234])
    with pytest.raises(ValueError, match="slot_payload_bytes: on disk 9000, asked for 20000"):
        DiskArena(disk_dir, 8 * SLOT_BYTES, 20000)
    with pytest.raises(ValueError, match="num_slots: on disk 8, asked for 4"):
        DiskArena(disk_dir, 4 * SLOT_BYTES, SLOT_PAYLOAD_BYTES)
    assert os.path.getsize(os.path.join(disk_dir, "slab-00000.bin")) == 8 * SLOT_BYTES
    with _arena(disk_dir) as reopened:
        assert reopened.scan() == [(items[0][0], _meta(*items[0][1:]))]


def test_slabs_without_manifest_are_refused(disk_dir):
    _arena(disk_dir).close()
    os.remove(os.path.join(disk_dir, "manifest.json"))
    with pytest.raises(ValueError, match="no manifest.json"):
        _arena(disk_dir)
    assert os.path.exists(os.path.join(disk_dir, "slab-00000.bin"))


@pytest.mark.parametrize(("key", "payload", "error", "match"), [
    (b"k" * 16, np.zeros(SLOT_PAYLOAD_BYTES + 1, np.uint8), ValueError, "exceeds"),
    (b"k" * 15, np.zeros(10, np.uint8), ValueError, "16 bytes"),
    ("k" * 16, np.zeros(10, np.uint8), TypeError, "key must be bytes"),
    (b"k" * 16, np.zeros(10, np.float32), TypeError, "uint8"),
    (b"k" * 16, np.zeros((2, 5), np.uint8), ValueError, "1-D"),
])
def test_bad_item_raises_before_anything_is_written(disk_dir, key, payload, error, match):
    with _arena(disk_dir) as arena:
        good = (0, _key(0), 0, _payload(0, 100))
        with pytest.raises(error, match=match):
            arena.write_pages([good, (1, key, 0, payload)])
        assert arena.bytes_written == 0
        assert arena.read_pages([0], [np.zeros(100, np.uint8)]) == [None]


def test_bad_slots_raise(disk_dir):
    with _arena(disk_dir) as arena:
        page = _payload(0, 10)
        with pytest.raises(ValueError, match="twice"):
            arena.write_pages([(1, _key(1), 0, page), (1, _key(2), 0, page)])
        with pytest.raises(ValueError, match=r"not in \[0, 8\)"):
            arena.write_pages([(8, _key(1), 0, page)])
        with pytest.raises(ValueError, match="2 slots but 1 outs"):
            arena.read_pages([0, 1], [np.zeros(10, np.uint8)])
        assert arena.bytes_written == 0


def test_tmpfs_round_trips_with_at_most_one_warning(shm_dir, monkeypatch):
    """Kernels before 6.6 refuse O_DIRECT on tmpfs (fallback); newer ones accept it."""
    monkeypatch.setattr(disk, "MAX_SLAB_FILE_BYTES", 2 * SLOT_BYTES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arena = _arena(shm_dir)
    runtime_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime_warnings) == (0 if arena.direct_io else 1)
    with arena:
        items = _write(arena, [5, 4097, 9000])
        outs = [np.zeros(9000, np.uint8) for _ in items]
        assert arena.read_pages([s for s, *_ in items], outs) == [_meta(*i[1:]) for i in items]


def test_refused_o_direct_falls_back_with_one_warning(shm_dir, monkeypatch):
    monkeypatch.setattr(disk, "MAX_SLAB_FILE_BYTES", 2 * SLOT_BYTES)
    real_open = disk._open_file

    def refuse_direct(path: str, flags: int) -> int:
        if flags & disk._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags)

    monkeypatch.setattr(disk, "_open_file", refuse_direct)
    with pytest.warns(RuntimeWarning, match="buffered I/O") as caught:
        arena = _arena(shm_dir)
    assert len(caught) == 1 and arena.num_files == 4
    assert arena.direct_io is False
    with arena:
        items = _write(arena, [5, 4097, 9000])
        outs = [aligned_empty(9000) for _ in items]
        assert arena.read_pages([s for s, *_ in items], outs) == [_meta(*i[1:]) for i in items]
        assert all(o[: p.nbytes].tobytes() == p.tobytes()
                   for o, (*_, p) in zip(outs, items, strict=True))


def test_o_direct_refused_at_read_time_falls_back(disk_dir, monkeypatch):
    monkeypatch.setattr(disk, "direct_reads_work", lambda fd: False)
    with pytest.warns(RuntimeWarning, match="O_DIRECT reads fail") as caught:
        arena = _arena(disk_dir)
    assert len(caught) == 1 and arena.direct_io is False
    with arena:
        items = _write(arena, [777])
        out = np.zeros(777, np.uint8)
        assert arena.read_pages([items[0][0]], [out]) == [_meta(*items[0][1:])]


def test_close_is_idempotent_and_final(disk_dir):
    arena = _arena(disk_dir)
    arena.close()
    arena.close()
    with pytest.raises(AssertionError, match="closed"):
        arena.read_pages([0], [np.zeros(10, np.uint8)])


def test_aligned_helpers():
    buffer = aligned_empty(5000)
    assert buffer.nbytes == 5000 and buffer.ctypes.data % 4096 == 0
    assert is_aligned(buffer) and not is_aligned(buffer[1:]) and not np.any(buffer)
    pool = AlignedBufferPool(8192, max_buffers=1)
    first, second = pool.acquire(), pool.acquire()
    assert first.ctypes.data != second.ctypes.data
    pool.release(first)
    pool.release(second)  # beyond max_buffers: dropped
    assert len(pool._free) == 1
    with pool.borrow() as borrowed:
        assert borrowed is first and len(pool._free) == 0
    assert len(pool._free) == 1
