"""Files in shared memory (/dev/shm), mapped by the node actor and by the clients on its node."""

from __future__ import annotations

import ctypes
import mmap
import os

SHM_DIR = os.environ.get("RAYKV_SHM_DIR", "/dev/shm")
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class SharedFile:
    """A file in shared memory, mapped read-write; unlinked by close(). Sparse: memory is
    taken only for what is written (or populated)."""

    def __init__(self, name: str, nbytes: int, populate: bool = True):
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            flags = mmap.MAP_SHARED | (populate_flag() if populate else 0)
            self.mmap = mmap.mmap(fd, nbytes, flags=flags)
        finally:
            os.close(fd)

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def map_file(path: str, populate: bool = True) -> mmap.mmap:
    """Map an existing shared-memory file read-write (FileNotFoundError once unlinked)."""
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | (populate_flag() if populate else 0)
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=flags)
    finally:
        os.close(fd)


def populate_flag() -> int:
    # Pre-fault the mapping: a fresh page costs a fault on first touch, which halves copy speed.
    return getattr(mmap, "MAP_POPULATE", 0)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def populate_range(address: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over [address, address + length), without holding the GIL
    (mmap.madvise holds it for the whole call: tens of ms for a chunk, which would stall every
    other thread of the process, the actor's event loop included). False where the kernel
    lacks it (before 5.14)."""
    return _libc.madvise(address, length, MADV_POPULATE_WRITE) == 0
