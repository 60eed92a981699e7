"""The CUDA path of the device tier: VRAM chunks from cupy's pool, granted and released
against the tier's budget, and mapped by another process through CUDA IPC. Marked `gpu`:
skipped where there is no CUDA device or no cupy."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from cluster.core.tiers.chunks import Share, TierBudget
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
