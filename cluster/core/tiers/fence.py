"""Write fences on the slots that writers fill after a reservation (a client's put through
shared memory, the node's pull from another node), across processes.

    writer (client put, node pull)            node (a reservation expires or is aborted)
    lock(slots)      non-blocking             generation[slot] += 1          the fence
    generations still the reserved ones?      try_lock(slot)
      no: unlock, write nothing                 held: quarantine the slot, try again later
    copy the bytes in                           free: unlock, then free the slot
    unlock

The lock is an open-file-description lock (fcntl F_OFD_SETLK) on the slot's 8 bytes of the
arena's generation file. It conflicts between any two opens of that file, in one process or
in two, and the kernel drops it when the process holding it dies. So a slot whose reservation
ran out is reused only once no writer can still copy into it: a writer that had not locked
yet sees the moved generation and writes nothing; one that had is waited for however long it
stalls (SIGSTOP, swapped out, a receive blocked on a slow peer); a dead one holds nothing.
Locks are advisory: readers never take them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Iterable

import numpy as np

GEN_BYTES = 8  # one uint64 generation per slot, at slot * GEN_BYTES (tiers/memory.py)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, len, pid (0 for OFD)
_BUSY = {errno.EAGAIN, errno.EACCES}


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, distinct slots as (first, count) runs of consecutive slots."""
    distinct = np.unique(np.fromiter(slots, dtype=np.int64))
    if not distinct.size:
        return []
    starts = np.flatnonzero(np.diff(distinct, prepend=distinct[0] - 2) != 1)
    counts = np.diff(np.append(starts, distinct.size))
    return list(zip(distinct[starts].tolist(), counts.tolist(), strict=True))


class SlotFence:
    """One open of an arena's generation file, through which slot write locks are taken.

    Each SlotFence is its own lock owner: two of them conflict even inside one process (the
    node's expiry and its own pulls use two). Thread-safe for disjoint slots.
    """

    def __init__(self, generations_path: str):
        self.path = generations_path
        self._fd = os.open(generations_path, os.O_RDWR | os.O_CLOEXEC)
        self._lock = threading.Lock()  # close() against a lock call in another thread

    def lock(self, slots: Iterable[int]) -> bool:
        """Take the write locks of `slots`, all or none; False when any is held elsewhere."""
        taken: list[tuple[int, int]] = []
        for run in slot_runs(slots):
            if not self._set(fcntl.F_WRLCK, *run):
                self.unlock_runs(taken)
                return False
            taken.append(run)
        return True

    def unlock(self, slots: Iterable[int]) -> None:
        self.unlock_runs(slot_runs(slots))

    def unlock_runs(self, runs: list[tuple[int, int]]) -> None:
        for run in runs:
            self._set(fcntl.F_UNLCK, *run)

    def try_claim(self, slot: int) -> bool:
        """True when no writer holds `slot`: nobody can be copying into it now (the lock is
        taken and let go at once; with its generation already moved, no later writer will)."""
        if not self._set(fcntl.F_WRLCK, slot, 1):
            return False
        self._set(fcntl.F_UNLCK, slot, 1)
        return True

    def _set(self, lock_type: int, first_slot: int, num_slots: int) -> bool:
        request = _FLOCK.pack(lock_type, os.SEEK_SET, first_slot * GEN_BYTES,
                              num_slots * GEN_BYTES, 0)
        with self._lock:
            if self._fd < 0:
                return False
            try:
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, request)
            except OSError as error:
                if error.errno in _BUSY:
                    return False
                raise
        return True

    def close(self) -> None:
        """Close the file (and with it every lock taken through it). Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
