"""A power cut, simulated: a process that owns a NodeStore is killed with SIGKILL, and then
every slab write it made that no fdatasync/fsync of its file covered is undone, as a disk
that loses its volatile write cache would.

    in the store's process:   os.pwritev  -> journal (file, offset, bytes there before), write
                              os.fdatasync/os.fsync -> call, then journal "synced (file)"
    after the kill:           undo_unsynced(journal): each write after its file's last
                              "synced", newest first, gets its old bytes back

The store's process runs `python -m tests.unit._power_cut DISK_DIR JOURNAL ACKS MODE PREFIX`
(PREFIX: its shared-memory files' prefix, for the cleanup after the kill): it puts
pages 0, 1, 2, ... into a store whose host tier holds 2 pages, so each put demotes one page to
disk, and appends the key of every page the store reports on disk (its on_event) to ACKS.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import sys
import threading

from cluster.core.geometry import DISK
from cluster.core.pool import PoolLimits
from cluster.core.store import NodeStore, StoreConfig
from tests.unit._pages import DISK_SLOT_BYTES, PAGE_BYTES
from tests.unit._pool_harness import store_put

NUM_PAGES = 400
DISK_PAGES = 512
_LENGTH = struct.Struct("<I")


def power_cut_config(disk_dir: str, mode: str, shm_prefix: str) -> StoreConfig:
    """Host 2 pages, no device tier, a disk tier for every page put. `mode` "default" leaves
    the durability at StoreConfig's default."""
    limits = PoolLimits(0, 2 * PAGE_BYTES, DISK_PAGES * DISK_SLOT_BYTES, "lru", "none", False,
                        shm_prefix)
    durability = {} if mode == "default" else {"disk_durability": mode}
    return StoreConfig(limits, disk_dir, disk_threads=2, **durability)


def _journal_writes(journal_path: str) -> None:
    """Patch os.pwritev, os.fdatasync and os.fsync of this process to journal slab writes."""
    fd = os.open(journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    lock = threading.Lock()
    real_pwritev, real_fdatasync, real_fsync = os.pwritev, os.fdatasync, os.fsync

    def note(record: tuple) -> None:
        blob = pickle.dumps(record)
        with lock:
            os.write(fd, _LENGTH.pack(len(blob)) + blob)

    def slab_path(file_fd: int) -> str | None:
        path = os.readlink(f"/proc/self/fd/{file_fd}")
        return path if os.path.basename(path).startswith("slab-") else None

    def pwritev(file_fd, buffers, offset, *args):
        path = slab_path(file_fd)
        if path is not None:
            length = sum(memoryview(b).nbytes for b in buffers)
            with open(path, "rb") as slab:  # buffered: coherent with O_DIRECT writes
                slab.seek(offset)
                before = slab.read(length)
            note(("write", path, offset, before))
        return real_pwritev(file_fd, buffers, offset, *args)

    def synced(real):
        def sync(file_fd):
            real(file_fd)
            path = slab_path(file_fd)
            if path is not None:
                note(("synced", path))
        return sync

    os.pwritev, os.fdatasync, os.fsync = pwritev, synced(real_fdatasync), synced(real_fsync)


def undo_unsynced(journal_path: str) -> int:
    """Give every write no sync covered its old bytes back; returns how many were undone."""
    records = []
    with open(journal_path, "rb") as journal:
        data = journal.read()
    position = 0
    while position + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, position)
        blob = data[position + _LENGTH.size : position + _LENGTH.size + length]
        if len(blob) < length:
            break  # the kill cut the last record short: its write never started
        records.append(pickle.loads(blob))
        position += _LENGTH.size + length
    last_sync = {r[1]: i for i, r in enumerate(records) if r[0] == "synced"}
    undone = 0
    for index in range(len(records) - 1, -1, -1):
        kind, path, *rest = records[index]
        if kind == "write" and index > last_sync.get(path, -1):
            offset, before = rest
            with open(path, "r+b") as slab:
                slab.seek(offset)
                slab.write(before)
                os.fsync(slab.fileno())
            undone += 1
    return undone


def main(disk_dir: str, journal_path: str, acks_path: str, mode: str, shm_prefix: str) -> None:
    _journal_writes(journal_path)
    acks = os.open(acks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def on_event(key: bytes, tier: int | None) -> None:
        if tier == DISK:  # what the node would tell the directory: the page is on disk
            os.write(acks, key.hex().encode() + b"\n")

    store = NodeStore(power_cut_config(disk_dir, mode, shm_prefix), on_event)
    for i in range(NUM_PAGES):
        asyncio.run(store_put(store, [i]))
    os.write(acks, b"done\n")
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main(*sys.argv[1:6])
