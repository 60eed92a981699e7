"""Where a disk arena's slots are: slab files of `slots_per_file` slots of `slot_bytes` each, in
one directory. Shared by the node's DiskArena (disk.py) and its clients' read-only DiskReader
(disk_reader.py), so that both find a slot at the same file and offset."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np


def slab_path(dir_path: str, index: int) -> str:
    return os.path.join(dir_path, f"slab-{index:05d}.bin")


def open_slabs(num_files: int, open_one: Callable[[int], int]) -> list[int]:
    """open_one(index) for each slab file; on any failure the files opened so far are closed
    and the error raised."""
    fds: list[int] = []
    try:
        for index in range(num_files):
            fds.append(open_one(index))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class SlabSlots:
    """A mixin: a slot's file and offset, and the check of a slot id. Uses slots_per_file,
    slot_bytes, num_slots and _fds (one per slab file, in order)."""

    def _locate(self, slot: int) -> tuple[int, int]:
        file_index, index_in_file = divmod(slot, self.slots_per_file)
        return self._fds[file_index], index_in_file * self.slot_bytes

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} is not in [0, {self.num_slots})")
