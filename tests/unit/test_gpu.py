"""The CUDA path of the device tier. Marked `gpu`: skipped on CPU-only machines."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cluster.core.tiers.memory import MappedArena

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOT_BYTES = 1 << 20


def test_device_arena_lives_in_cuda_memory_and_round_trips():
    arena = MappedArena("device", 4 * SLOT_BYTES, SLOT_BYTES, use_cuda=True, shm_prefix="t")
    assert arena.tensor.is_cuda and arena.num_slots == 4
    slot = arena.alloc()
    page = torch.randint(0, 255, (SLOT_BYTES,), dtype=torch.uint8, device="cuda")
    arena.view(slot).copy_(page)
    assert torch.equal(arena.view(slot), page)
    assert arena.descriptor().cuda_handle is not None


def test_another_process_maps_the_device_arena_through_cuda_ipc(tmp_path):
    arena = MappedArena("device", 2 * SLOT_BYTES, SLOT_BYTES, use_cuda=True, shm_prefix="t")
    slot = arena.alloc()
    arena.view(slot).fill_(7)
    torch.cuda.synchronize()
    handle_file = tmp_path / "descriptor.pt"
    torch.save(arena.descriptor(), handle_file)
    script = ("import torch, sys; from cluster.core.tiers.memory import ArenaMapping; "
              f"m = ArenaMapping(torch.load({str(handle_file)!r}, weights_only=False)); "
              f"print(int(m.view({slot}).sum().item()))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == 7 * SLOT_BYTES
