"""The node actor's VRAM, outside vLLM's accounting (issue 15, finding 4): device_bytes is
per GPU, a start-up check refuses a GPU short of it and names the largest
gpu_memory_utilization the engines may use, and host<->device page moves run in a copy
thread (on a CUDA stream on GPUs), off the event loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.core.config import CacheConfig
from cluster.core.geometry import DEVICE, HOST
from cluster.core.tiers.device_copy import TierCopies
from cluster.core.tiers.gpus import (
    GpuMemory,
    VramBudgetError,
    describe_budget,
    vram_budget,
)
from tests.unit._pages import key, page_bytes
from tests.unit._pool_harness import new_owner, put, run, write_pages

MiB, GiB = 1 << 20, 1 << 30


def test_the_budget_names_the_engines_largest_gpu_memory_utilization():
    gpus = [GpuMemory("GPU-a", 80 * GiB, 79 * GiB), GpuMemory("GPU-b", 80 * GiB, 60 * GiB)]
    shares = vram_budget(4 * GiB, gpus, context_bytes=512 * MiB)
    # (80 GiB - 4 GiB - 512 MiB) / 80 GiB = 0.94375: an engine may ask for 0.94 of the GPU
    assert [s.max_gpu_memory_utilization for s in shares] == [0.94, 0.94]
    assert [(s.uuid, s.device_bytes, s.context_bytes) for s in shares] == [
        ("GPU-a", 4 * GiB, 512 * MiB), ("GPU-b", 4 * GiB, 512 * MiB)]
    line = describe_budget(shares)
    assert "2 GPU(s), each 4096 MiB of chunks + ~512 MiB CUDA context" in line
    assert line.endswith("gpu_memory_utilization <= 0.94")
    h200 = GpuMemory("GPU-h", 143771 * MiB, 140000 * MiB)
    assert vram_budget(16 * GiB, [h200], 512 * MiB)[0].max_gpu_memory_utilization == 0.88
    assert vram_budget(0, [h200], 512 * MiB)[0].max_gpu_memory_utilization == 0.99


def test_a_gpu_short_of_device_bytes_is_refused_with_the_fix():
    """Engines started first hold most of GPU-b: raykv refuses before taking any VRAM."""
    gpus = [GpuMemory("GPU-a", 80 * GiB, 70 * GiB), GpuMemory("GPU-b", 80 * GiB, 2 * GiB)]
    with pytest.raises(VramBudgetError) as refused:
        vram_budget(4 * GiB, gpus, context_bytes=512 * MiB)
    message = str(refused.value)
    assert "device_bytes=4096 MiB on every GPU" in message
    assert "GPU-b has 2048 MiB free of 81920 MiB" in message and "GPU-a" not in message
    assert "at most 2048 MiB" in message and "gpu_memory_utilization of at most 0.94" in message


def test_device_bytes_is_per_gpu_in_the_node_store_and_its_docs(monkeypatch):
    import actors.node_cache as node_cache
    from cluster.core.tiers.node_slot import NodeSlot

    slot = NodeSlot(0, "/tmp/raykv-test-slot", "raykvtest-slot", -1)
    config = CacheConfig(device_bytes=256 * MiB, disk_dir="/tmp")
    monkeypatch.setattr(node_cache, "num_cuda_devices", lambda: 4)
    monkeypatch.setattr(node_cache, "cupy_available", lambda: True)
    limits = node_cache.store_config(config, slot).limits
    assert (limits.device_bytes, limits.num_devices, limits.use_cuda) == (1024 * MiB, 4, True)
    monkeypatch.setattr(node_cache, "cupy_available", lambda: False)  # VRAM needs cupy
    limits = node_cache.store_config(config, slot).limits
    assert (limits.device_bytes, limits.use_cuda) == (256 * MiB, False)
    assert "per GPU" in CacheConfig.model_fields["device_bytes"].description
    assert "per GPU" in CacheConfig.__doc__ and "gpu_memory_utilization" in CacheConfig.__doc__


def test_raykv_start_help_says_device_bytes_is_per_gpu():
    from typer.testing import CliRunner

    from cluster.tools.cli import app

    result = CliRunner().invoke(app, ["start", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "device (VRAM) tier per GPU" in " ".join(result.output.split())


def test_a_promotion_to_the_device_tier_runs_off_the_event_loop(harness):
    """The loop serves other requests while a page moves host -> device (on a GPU: the copy
    thread's CUDA stream; here the same path, without a stream)."""
    pool = harness.make(device_pages=2, host_pages=2, disk_pages=0)
    owner = new_owner()
    slots = asyncio.run(pool.reserve([key(0)], owner, HOST))
    write_pages(pool, [0], slots)
    pool.commit([key(0)], owner)

    async def promote_while_ticking() -> int:
        ticks, done = 0, asyncio.ensure_future(pool.promote_many([key(0)]))
        while not done.done():
            ticks += 1
            await asyncio.sleep(0)
        await done
        return ticks

    assert asyncio.run(promote_while_ticking()) > 1  # the loop ran while the copy did
    entry = pool.index[key(0)]
    assert entry.tier == DEVICE
    assert torch.equal(pool.memory[DEVICE].view(entry.slot)[: page_bytes(0).numel()],
                       page_bytes(0))


def test_a_page_pinned_while_it_moves_stays_where_its_reader_found_it(harness):
    pool = harness.make(device_pages=2, host_pages=2, disk_pages=0)
    owner = new_owner()
    slots = asyncio.run(pool.reserve([key(0)], owner, HOST))
    write_pages(pool, [0], slots)
    pool.commit([key(0)], owner)
    host_slot = pool.index[key(0)].slot

    async def pinned_meanwhile():
        moving = asyncio.ensure_future(pool.promote_many([key(0)]))
        await asyncio.sleep(0)  # the copy is under way in the copy thread
        pool.index[key(0)].pins += 1  # a reader pins the page where it is
        await moving

    asyncio.run(pinned_meanwhile())
    assert (pool.index[key(0)].tier, pool.index[key(0)].slot) == (HOST, host_slot)
    assert pool.memory[DEVICE].slots.num_used == 0  # the copy's slot went back


def test_tier_copies_move_every_byte_in_the_copy_thread():
    copies = TierCopies()
    try:
        pairs = [(torch.zeros(4096, dtype=torch.uint8), torch.full((4096,), i, dtype=torch.uint8))
                 for i in range(3)]
        asyncio.run(copies.copy(pairs))
        assert all(torch.equal(dst, src) for dst, src in pairs) and copies.num_batches == 1
        asyncio.run(copies.copy([]))
        assert copies.num_batches == 1  # nothing to move: no trip to the thread
    finally:
        copies.close()


def test_a_page_pinned_while_its_move_makes_room_stays_where_its_reader_found_it(harness):
    """A reader that pins the page while the promotion is still making room (demoting a
    victim, or faulting a chunk in, both awaited) keeps it where it found it, as one that pins
    it during the copy does: the move is judged by the pins it was decided with."""
    pool = harness.make(device_pages=1, host_pages=2, disk_pages=0)
    run(put(pool, [0]))  # on the device tier
    owner = new_owner()
    slots = asyncio.run(pool.reserve([key(1)], owner, HOST))
    write_pages(pool, [1], slots)
    pool.commit([key(1)], owner)
    host_slot = pool.index[key(1)].slot
    made_room = pool.make_room

    async def make_room_pinned_meanwhile(tier, num_pages, namespace="", **options):
        pool.index[key(1)].pins += 1  # a reader pins the page while room is being made
        return await made_room(tier, num_pages, namespace, **options)

    pool.make_room = make_room_pinned_meanwhile
    asyncio.run(pool.promote_many([key(1)]))
    assert (pool.index[key(1)].tier, pool.index[key(1)].slot) == (HOST, host_slot)
