"""What the disk tier keeps across a restart: every page it reported on disk (durable mode,
even through a power cut), none that was discarded, and each page's namespace."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from cluster.core.geometry import DISK
from cluster.core.store import NodeStore
from cluster.core.tiers.memory import remove_stale_shm
from policies.quota import Quota
from tests.unit._pages import DISK_SLOT_BYTES, GEOMETRY, key, page_bytes, unique_prefix
from tests.unit._pool_harness import run, store_put_each, write_pages
from tests.unit._power_cut import power_cut_config, undo_unsynced
from tests.waiting import wait_until

G = GEOMETRY
ACKS_BEFORE_CUT = 24


def _page_id(page_key: bytes) -> int:
    return int.from_bytes(page_key[1:], "little")


def _acked(acks_path: str) -> list[bytes]:
    with open(acks_path) as handle:
        lines = handle.read().split()
    return [bytes.fromhex(line) for line in lines if len(line) == 32]


def _cut_power(tmp_path, mode: str) -> tuple[list[bytes], str]:
    """Run a store in its own process, SIGKILL it while it demotes pages to disk, undo every
    write no sync covered; (the keys it reported on disk before the kill, its disk dir)."""
    disk_dir, journal, acks = (str(tmp_path / name) for name in ("disk", "journal", "acks"))
    prefix = unique_prefix()
    process = subprocess.Popen([sys.executable, "-m", "tests.unit._power_cut", disk_dir,
                                journal, acks, mode, prefix],
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_until(lambda: process.poll() is not None or (
            os.path.exists(acks) and len(_acked(acks)) >= ACKS_BEFORE_CUT), 120,
            "the store to report pages on disk")
        assert process.poll() is None, "the store's process died before the cut"
        process.send_signal(signal.SIGKILL)  # mid-stream: it is still writing pages
    finally:
        process.kill()
        process.wait(10)
        remove_stale_shm(prefix)
    acked = _acked(acks)
    assert len(acked) >= ACKS_BEFORE_CUT
    undo_unsynced(journal)
    return acked, disk_dir


def _recovered(disk_dir: str, keys: list[bytes]) -> dict[bytes, np.ndarray]:
    """A fresh store on the disk dir: the pages among `keys` it recovers, with their bytes."""
    store = NodeStore(power_cut_config(disk_dir, "default", unique_prefix()), lambda k, t: None)
    try:
        store.recover_disk()
        found = {k: asyncio.run(store.map_pages(G, [k], np.copy)) for k in keys}
        return {k: pages[0] for k, pages in found.items() if pages}
    finally:
        store.close()


def test_a_power_cut_loses_no_page_reported_on_disk_in_durable_mode(tmp_path):
    acked, disk_dir = _cut_power(tmp_path, "default")  # durable is the default
    recovered = _recovered(disk_dir, acked)
    lost = [_page_id(k) for k in acked if k not in recovered]
    assert not lost, f"pages reported on disk and lost in the power cut: {lost}"
    for k, got in recovered.items():
        assert np.array_equal(got, page_bytes(_page_id(k)).numpy())


def test_a_power_cut_in_volatile_mode_may_lose_pages_but_never_gives_wrong_bytes(tmp_path):
    """The simulation bites: without fdatasync, pages reported on disk are lost."""
    acked, disk_dir = _cut_power(tmp_path, "volatile")
    recovered = _recovered(disk_dir, acked)
    assert len(recovered) < len(acked)
    for k, got in recovered.items():
        assert np.array_equal(got, page_bytes(_page_id(k)).numpy())


@pytest.mark.parametrize("restart", ["clean", "crash after the tidy"])
def test_discarded_disk_pages_stay_discarded_after_a_restart(stores, restart):
    config = stores.config(device_pages=0, host_pages=2, disk_pages=8)
    store = stores.make(config)
    run(store_put_each(store, range(6)))  # 0..3 on disk, 4 and 5 in host
    assert store.discard(G, [key(1), key(2)]) == 2
    if restart == "clean":
        store.close()
    else:  # the node's periodic tidy ran, then the process died without closing anything
        run(store.shrink_idle(3600.0))
    again = stores.make(config)
    again.recover_disk()
    on_disk = sorted(_page_id(k) for k, e in again.pool(G).index.items() if e.tier == DISK)
    assert on_disk == [0, 3], f"discarded pages came back: {on_disk}"


def test_recovered_pages_keep_their_namespace_and_count_against_its_quota(stores):
    config = stores.config(device_pages=0, host_pages=2, disk_pages=8)
    store = stores.make(config)
    for i in range(5):
        reservation_id, slots = run(store.reserve(G, [key(i)], None, "tenant-a"))
        write_pages(store.pool(G), [i], slots)
        assert store.commit(reservation_id) == 1
    on_disk = [k for k, e in store.pool(G).index.items() if e.tier == DISK]
    assert len(on_disk) == 3
    store.close()
    again = stores.make(config)
    assert again.recover_disk() == 3
    assert {again.pool(G).index[k].namespace for k in on_disk} == {"tenant-a"}
    assert again.elastic.namespace_bytes(DISK) == {"tenant-a": 3 * DISK_SLOT_BYTES}
    again.set_quotas({}, {"tenant-a": Quota(max_bytes=4 * DISK_SLOT_BYTES)})
    assert again.elastic.room(DISK, "tenant-a") == DISK_SLOT_BYTES
