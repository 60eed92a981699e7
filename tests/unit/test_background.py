"""Small core pieces the actors lean on: kept-alive background loops (a loop that raises goes
on; a task is not garbage-collected), shared in-flight claims, private files and directories,
and the /dev/shm room check."""

from __future__ import annotations

import asyncio
import gc
import os
import stat

import pytest

from cluster.core.claims import InflightClaims
from cluster.core.config import default_disk_dir
from cluster.core.tiers.aligned import make_private_dir, open_private, write_private_text
from cluster.core.tiers.disk import DiskArena
from cluster.core.tiers.memory import SharedMemoryTooSmall, check_shm_room, shm_free_bytes
from cluster.core.tiers.node_slot import claim_node_slot
from tests.unit._pages import make_disk_dir, remove_dir


def test_a_loop_that_raises_goes_on_and_counts_its_errors(caplog):
    from cluster.core.loops import BackgroundLoops

    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("boom")

    async def main():
        loops = BackgroundLoops()
        loops.every("purge", 0.001, flaky)
        del flaky_ref[:]  # nothing but `loops` holds the task now
        gc.collect()
        while len(calls) < 5:
            await asyncio.sleep(0.002)
        running = loops.running()
        loops.cancel_all()
        await asyncio.sleep(0)
        return loops, running

    flaky_ref = [flaky]
    loops, running = asyncio.run(main())
    assert running == ["purge"]
    assert loops.errors == {"purge": 2}
    assert "background loop purge failed" in caplog.text


def test_inflight_claims_share_work():
    async def main():
        claims = InflightClaims()
        todo, waits, done = claims.claim(["a", "b"])
        assert todo == ["a", "b"] and waits == set() and "a" in claims
        todo2, waits2, done2 = claims.claim(["b", "c", "c"])
        assert todo2 == ["c"] and waits2 == {done}
        waiter = asyncio.ensure_future(claims.wait(waits2))
        await asyncio.sleep(0)
        assert not waiter.done()
        claims.finish(todo, done)
        await waiter
        claims.finish(todo2, done2)
        assert len(claims) == 0

    asyncio.run(main())


def test_private_dirs_and_files_are_0700_and_0600():
    root = make_disk_dir()
    try:
        path = os.path.join(root, "a", "b")
        os.makedirs(os.path.join(root, "loose"), mode=0o755)
        os.chmod(os.path.join(root, "loose"), 0o755)
        make_private_dir(path)
        make_private_dir(os.path.join(root, "loose"))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.join(root, "loose")).st_mode) == 0o700
        write_private_text(os.path.join(path, "f.json"), "{}")
        assert stat.S_IMODE(os.stat(os.path.join(path, "f.json")).st_mode) == 0o600
        loose_file = os.path.join(path, "g")
        with open(loose_file, "w") as handle:
            handle.write("x")
        os.chmod(loose_file, 0o644)
        os.close(open_private(loose_file, os.O_RDWR))
        assert stat.S_IMODE(os.stat(loose_file).st_mode) == 0o600
    finally:
        remove_dir(root)


def test_slabs_and_node_slots_are_private():
    root = make_disk_dir()
    try:
        slot = claim_node_slot(os.path.join(root, "raykv"))
        arena = DiskArena(os.path.join(slot.disk_dir, "pool"), 3 * 8192, 4096, 1)
        arena.close()
        for dirpath, _, filenames in os.walk(os.path.join(root, "raykv")):
            assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
            for name in filenames:
                mode = stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode)
                assert mode == 0o600, (name, oct(mode))
        slot.release()
    finally:
        remove_dir(root)


def test_a_directory_of_another_user_is_refused(monkeypatch):
    root = make_disk_dir()
    try:
        monkeypatch.setattr(os, "getuid", lambda: 12345)
        with pytest.raises(PermissionError, match="uid"):
            make_private_dir(root)
    finally:
        monkeypatch.undo()
        remove_dir(root)


def test_the_default_disk_dir_is_per_user(monkeypatch):
    monkeypatch.delenv("RAYKV_DISK_DIR", raising=False)
    assert f"raykv-{os.getuid()}" in default_disk_dir()
    monkeypatch.setenv("RAYKV_DISK_DIR", "/somewhere")
    assert default_disk_dir() == "/somewhere"


def test_shm_room_check_names_the_bytes_and_the_fix():
    check_shm_room(1 << 20)
    needed = shm_free_bytes() + (1 << 30)
    with pytest.raises(SharedMemoryTooSmall) as error:
        check_shm_room(needed)
    message = str(error.value)
    assert f"{needed} bytes" in message
    assert "--shm-size" in message and "medium: Memory" in message
