"""Damage a node's disk slabs from outside, as a failing disk or a crash would (test-only):
flip bytes in stored pages, or tear a slab by truncating it in the middle of a page.

A node's disk tier lives in `{disk_dir}/{geometry name}/slab-NNNNN.bin`, next to a
manifest.json that gives the slot layout. Each slot is a 4096-byte header (magic "RKVP",
key, payload size, xxh3 of the payload, xxh3 of the header) then the payload. The disk tier
must read any damaged page as a miss, never as other bytes.
"""

from __future__ import annotations

import json
import os

from cluster.core.tiers.disk_format import HEADER_BYTES, MAGIC, MANIFEST_NAME


def pool_dirs(disk_dir: str) -> list[str]:
    """The pool directories (one per page geometry) of one node's slot directory."""
    if not os.path.isdir(disk_dir):
        return []
    return sorted(os.path.join(disk_dir, name) for name in os.listdir(disk_dir)
                  if os.path.isfile(os.path.join(disk_dir, name, MANIFEST_NAME)))


def _layout(pool_dir: str) -> dict:
    with open(os.path.join(pool_dir, MANIFEST_NAME)) as handle:
        return json.load(handle)


def _used_offsets(path: str, slot_bytes: int) -> list[int]:
    """Offsets of the slots of a slab file whose header starts with the magic."""
    offsets = []
    with open(path, "rb") as slab:
        size_bytes = os.fstat(slab.fileno()).st_size
        for offset in range(0, size_bytes - slot_bytes + 1, slot_bytes):
            slab.seek(offset)
            if slab.read(len(MAGIC)) == MAGIC:
                offsets.append(offset)
    return offsets


def _slabs(pool_dir: str) -> list[str]:
    return sorted(os.path.join(pool_dir, name) for name in os.listdir(pool_dir)
                  if name.startswith("slab-"))


def flip_page_bytes(disk_dir: str, payload_offset: int = 100) -> int:
    """XOR one payload byte of every stored page of every pool with 0xFF (fsynced, so a
    direct read sees it); returns how many pages were damaged."""
    flipped = 0
    for pool_dir in pool_dirs(disk_dir):
        slot_bytes = _layout(pool_dir)["slot_bytes"]
        for path in _slabs(pool_dir):
            with open(path, "r+b") as slab:
                for offset in _used_offsets(path, slot_bytes):
                    slab.seek(offset + HEADER_BYTES + payload_offset)
                    byte = slab.read(1)
                    slab.seek(offset + HEADER_BYTES + payload_offset)
                    slab.write(bytes([byte[0] ^ 0xFF]))
                    flipped += 1
                slab.flush()
                os.fsync(slab.fileno())
    return flipped


def tear_slab(disk_dir: str) -> int:
    """Truncate each pool's first slab in the middle of the payload of its first stored page
    past the middle: as a write torn by a crash, and everything after it lost. Returns how
    many stored pages were cut off or torn."""
    torn = 0
    for pool_dir in pool_dirs(disk_dir):
        layout = _layout(pool_dir)
        slabs = _slabs(pool_dir)
        if not slabs:
            continue
        offsets = _used_offsets(slabs[0], layout["slot_bytes"])
        if not offsets:
            continue
        cut = offsets[len(offsets) // 2]
        os.truncate(slabs[0], cut + HEADER_BYTES + layout["slot_payload_bytes"] // 2)
        torn += len(offsets) - len(offsets) // 2
    return torn


def files_under(path: str) -> list[str]:
    """Every file below `path` (slab files, manifests, lock files)."""
    found = []
    for root, _, names in os.walk(path):
        found += [os.path.join(root, name) for name in names]
    return sorted(found)


def shm_segments(shm_prefix: str) -> list[str]:
    """/dev/shm entries whose name starts with `shm_prefix` (a node slot's or a disk root's)."""
    from cluster.core.tiers.memory import SHM_DIR

    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(shm_prefix))
