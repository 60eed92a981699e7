"""4096-aligned host buffers and the file helpers of O_DIRECT I/O.

An anonymous mmap starts on a page boundary, so a numpy view of one satisfies O_DIRECT's rule
for buffer addresses; lengths are the caller's to round (`round_up`). Buffers are zero-filled
when mapped and are meant to be reused, not reallocated per page:

    pool: [buf, buf, buf]   acquire() pops one (or maps a new one when empty);
                            release() pushes it back, keeping at most max_buffers;
                            any extra is dropped and unmapped by the GC.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

ALIGN_BYTES = 4096
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


def round_up(value: int, multiple: int = ALIGN_BYTES) -> int:
    return (value + multiple - 1) // multiple * multiple


def aligned_empty(nbytes: int) -> np.ndarray:
    """A zeroed 1-D uint8 array of `nbytes`, starting on a 4096 boundary (anonymous mmap)."""
    assert nbytes >= 0, f"nbytes must be >= 0, got {nbytes}"
    region = mmap.mmap(-1, max(round_up(nbytes), ALIGN_BYTES))
    return np.frombuffer(region, dtype=np.uint8)[:nbytes]  # the array keeps the mmap alive


def is_aligned(array: np.ndarray) -> bool:
    """True when `array` is C-contiguous and starts on a 4096 boundary (lengths not checked)."""
    return bool(array.flags.c_contiguous) and array.ctypes.data % ALIGN_BYTES == 0


class AlignedBufferPool:
    """A thread-safe free list of equal-size aligned buffers."""

    def __init__(self, buffer_bytes: int, max_buffers: int) -> None:
        assert buffer_bytes > 0, f"buffer_bytes must be > 0, got {buffer_bytes}"
        assert max_buffers >= 0, f"max_buffers must be >= 0, got {max_buffers}"
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_empty(self.buffer_bytes)

    def release(self, buffer: np.ndarray) -> None:
        assert buffer.nbytes == self.buffer_bytes, "buffer does not belong to this pool"
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buffer)

    @contextmanager
    def borrow(self) -> Iterator[np.ndarray]:
        buffer = self.acquire()
        try:
            yield buffer
        finally:
            self.release(buffer)



def allocate_range(fd: int, offset: int, length: int) -> None:
    """Give [offset, offset + length) real blocks (posix_fallocate), if the filesystem can;
    ENOSPC and other real failures raise OSError."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno not in _NO_FALLOCATE:
            raise


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the blocks of [offset, offset + length) while the file keeps its size (Linux
    fallocate PUNCH_HOLE); False where that is not available. Best effort."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.fallocate(ctypes.c_int(fd),
                                ctypes.c_int(_FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE),
                                ctypes.c_longlong(offset), ctypes.c_longlong(length))
    except (OSError, AttributeError):
        return False
    return result == 0


def direct_reads_work(fd: int) -> bool:
    """False when an O_DIRECT fd refuses aligned reads (some filesystems accept the flag at
    open() and refuse it at read time). The file must hold at least ALIGN_BYTES."""
    try:
        os.preadv(fd, [aligned_empty(ALIGN_BYTES)], 0)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    return True


def pwritev_all(fd: int, iovecs: list[np.ndarray], offset: int) -> int:
    """os.pwritev that treats a short write as an OSError; returns the bytes written."""
    total_bytes = sum(iovec.nbytes for iovec in iovecs)
    written_bytes = os.pwritev(fd, iovecs, offset)
    if written_bytes != total_bytes:
        raise OSError(errno.EIO, f"short write: {written_bytes} of {total_bytes} bytes")
    return written_bytes


# ---- private files: the slabs hold other tenants' KV, so nobody else may read or plant them ----

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dir(path: str) -> str:
    """Create `path` (and missing parents) as 0700; an existing one must be ours, and is
    tightened to 0700. Raises PermissionError for a directory another user owns."""
    created = not os.path.isdir(path)
    os.makedirs(path, mode=PRIVATE_DIR_MODE, exist_ok=True)
    if created:  # its entry in the parent, durable
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to this user "
                              f"({os.getuid()}); refusing to keep KV pages there")
    if info.st_mode & 0o777 != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def open_private(path: str, flags: int) -> int:
    """os.open with mode 0600, tightening a file that already existed with looser bits."""
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    if os.fstat(fd).st_mode & 0o777 != PRIVATE_FILE_MODE:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    return fd


def write_private_text(path: str, text: str) -> None:
    """Write a small file atomically (temp file, fsync, rename, fsync of its directory: the
    rename itself is then durable too), mode 0600."""
    fd = open_private(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    """fsync a directory, so that the files created, renamed or removed in it survive a
    power cut (POSIX does not promise it otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
