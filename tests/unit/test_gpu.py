"""The CUDA path of the device tier: one cudaMalloc per VRAM chunk, granted and released
against the tier's budget, and mapped by another process through CUDA IPC (by GPU UUID).
Marked `gpu`: skipped where there is no CUDA device or no cupy. `make gpu-check` runs the
same paths without pytest or Ray (cluster/tools/gpu_check.py)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from cluster.core.tiers.chunks import Share, TierBudget
from cluster.core.tiers.gpus import local_gpu_uuids
from cluster.core.tiers.memory import ArenaOptions, MappedArena

cupy = pytest.importorskip("cupy", reason="the GPU path needs cupy (pip install raykv[gpu])")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOT_BYTES = 1 << 20


def gpu_arena(num_slots: int, budget: TierBudget, slots_per_chunk: int = 2) -> MappedArena:
    share = Share(budget, "model", slots_per_chunk * SLOT_BYTES)
    return MappedArena("device", num_slots * SLOT_BYTES, SLOT_BYTES,
                       ArenaOptions(use_cuda=True, shm_prefix="raykvgputest", share=share))


def test_device_chunks_live_in_vram_grow_and_shrink_with_the_budget():
    budget = TierBudget(4 * SLOT_BYTES)
    arena = gpu_arena(8, budget)
    slots = [arena.alloc() for _ in range(5)]
    assert slots[-1] is None and budget.free_bytes == 0  # two chunks of two: the budget
    page = torch.randint(0, 255, (SLOT_BYTES,), dtype=torch.uint8, device="cuda")
    arena.view(slots[0]).copy_(page)
    assert arena.view(slots[0]).is_cuda and torch.equal(arena.view(slots[0]), page)
    before = arena.layout_version
    for slot in slots[2:4]:
        arena.free(slot)
    assert arena.slots.release_empty() == 1 and budget.free_bytes == 2 * SLOT_BYTES
    assert arena.layout_version > before
    arena.close()


def test_another_process_maps_the_chunks_through_cuda_ipc(tmp_path):
    arena = gpu_arena(4, TierBudget(4 * SLOT_BYTES))
    slot = arena.alloc()
    arena.view(slot).fill_(7)
    torch.cuda.synchronize()
    descriptor_file = tmp_path / "descriptor.pkl"
    descriptor_file.write_bytes(pickle.dumps(arena.descriptor()))
    script = ("import pickle; from cluster.core.tiers.memory import ArenaMapping; "
              f"m = ArenaMapping(pickle.loads(open({str(descriptor_file)!r}, 'rb').read())); "
              f"print(int(m.view({slot}).sum().item()))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == 7 * SLOT_BYTES
    arena.close()


def test_vram_chunks_spread_over_every_gpu():
    num_gpus = torch.cuda.device_count()
    share = Share(TierBudget(2 * num_gpus * SLOT_BYTES), "model", SLOT_BYTES)
    arena = MappedArena("device", 2 * num_gpus * SLOT_BYTES, SLOT_BYTES,
                        ArenaOptions(use_cuda=True, shm_prefix="raykvgputest", share=share,
                                     num_devices=num_gpus))
    slots = [arena.alloc() for _ in range(2 * num_gpus)]
    devices = {arena.view(slot).device.index for slot in slots}
    assert devices == set(range(num_gpus))  # each chunk on the least-filled GPU
    chunks = arena.descriptor().device_layout.chunks
    assert {c.gpu_uuid for c in chunks} == set(local_gpu_uuids())  # named by UUID
    assert all(c.nbytes == SLOT_BYTES and c.ipc_handle for c in chunks)
    arena.close()


def test_a_released_chunk_goes_back_to_the_driver():
    arena = gpu_arena(4, TierBudget(4 * SLOT_BYTES), slots_per_chunk=4)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    slots = [arena.alloc() for _ in range(4)]
    held, _ = torch.cuda.mem_get_info()
    for slot in slots:
        arena.free(slot)
    arena.slots.release_empty()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - held >= 4 * SLOT_BYTES  # a cudaMalloc of its own ...
    assert free_after >= free_before - SLOT_BYTES  # ... and cudaFree on release
    arena.close()


def test_copies_into_vram_are_done_when_copy_pages_returns():
    from cluster.core.copies import copy_pages

    arena = gpu_arena(4, TierBudget(4 * SLOT_BYTES))
    slots = [arena.alloc() for _ in range(4)]
    pages = [torch.full((SLOT_BYTES,), i + 1, dtype=torch.uint8).pin_memory() for i in range(4)]
    copy_pages([(arena.view(slot), page) for slot, page in zip(slots, pages, strict=True)])
    # Nothing queued any more: a commit or a release right after cannot race the copies.
    assert all(torch.cuda.current_stream(d).query() for d in range(torch.cuda.device_count()))
    back = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in slots]
    copy_pages([(out, arena.view(slot)) for out, slot in zip(back, slots, strict=True)])
    assert [int(b[0]) for b in back] == [1, 2, 3, 4] and all(int(b[-1]) for b in back)
    arena.close()


def test_the_page_server_sends_vram_pages_through_host_staging():
    from cluster.core.dataplane.auth import Authority, Guard
    from cluster.core.dataplane.connections import ConnectionPool
    from cluster.core.dataplane.endpoint import PageRead, TensorPages
    from cluster.core.dataplane.reader import read_pages
    from cluster.core.dataplane.server import Listen, PageServer, ServedPages
    from cluster.core.geometry import PageGeometry

    geometry = PageGeometry((4, 2, 2, 16, 32), "bfloat16")
    pages = [torch.randint(0, 256, (geometry.page_bytes,), dtype=torch.uint8, device="cuda")
             for _ in range(2)]

    class VramSource:
        def open(self, request):
            return ServedPages(tuple(pages), None)

        def verify(self, served):
            return len(served.pages)

        def close(self, served):
            pass

    guard = Guard(b"p" * 32, b"n" * 32, {"t": b"t" * 32}.get)
    server = PageServer(VramSource(), Listen("127.0.0.1", 0, guard), 5.0)
    pool = ConnectionPool()
    try:
        out = torch.zeros(4, 2, 2, 32, 32, dtype=torch.bfloat16)
        slices = [out[:, :, :, :16], out[:, :, :, 16:]]
        read = PageRead(server.endpoint, geometry, (b"a" * 16, b"b" * 16),
                        TensorPages(out, slices),
                        Authority.of_namespace(b"p" * 32, "t", b"t" * 32))
        assert read_pages(pool, [read], 5.0) == [2]
        for got, page in zip(slices, pages, strict=True):
            assert torch.equal(got.contiguous().view(-1).view(torch.uint8), page.cpu())
    finally:
        pool.close()
        server.close()
