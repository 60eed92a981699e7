"""Shared helpers of the pool and store unit tests: a tiny page geometry, page contents, and
temp directories on the real disk (O_DIRECT does not work on tmpfs)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import torch

from cluster.core.geometry import PageGeometry
from cluster.core.tiers.disk import HEADER_BYTES
from cluster.core.tiers.memory import SHM_DIR

GEOMETRY = PageGeometry((2, 2, 2, 16, 16), "float32")
PAGE_BYTES = GEOMETRY.page_bytes  # 8192
DISK_SLOT_BYTES = HEADER_BYTES + PAGE_BYTES  # 12288


def key(i: int) -> bytes:
    return b"p" + i.to_bytes(15, "little")


def page(i: int) -> torch.Tensor:
    """Page i's values: seeded normal floats, so every page differs and is reproducible."""
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(GEOMETRY.shape, generator=generator, dtype=torch.float32)


def page_bytes(i: int) -> torch.Tensor:
    return page(i).view(torch.uint8).reshape(-1)


def as_page(raw: torch.Tensor) -> torch.Tensor:
    return raw[:PAGE_BYTES].clone().view(torch.float32).view(GEOMETRY.shape)


def make_disk_dir() -> str:
    return tempfile.mkdtemp(prefix="raykv-unit-", dir="/tmp")


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def unique_prefix() -> str:
    return f"raykvtest{uuid.uuid4().hex[:10]}"


def shm_files(prefix: str) -> list[str]:
    """Names of the shm files (slabs and generation tables) under a store's prefix."""
    return [name for name in os.listdir(SHM_DIR) if name.startswith(prefix + "-")]


def flip_disk_byte(pool_dir: str, slot: int, payload_offset: int = 100) -> None:
    """Corrupt one payload byte of a disk slot in slab-00000.bin."""
    path = os.path.join(pool_dir, "slab-00000.bin")
    offset = slot * DISK_SLOT_BYTES + HEADER_BYTES + payload_offset
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
        handle.flush()
        os.fsync(handle.fileno())
