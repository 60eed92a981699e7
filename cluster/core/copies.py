"""Page copies between the caller's tensors and the slabs, at memory speed.

CPU copies go through numpy: torch's OpenMP copy stalls when its threads share the cores with
Ray's processes, while np.copyto runs at memcpy speed and releases the GIL. A batch of pages
worth splitting is copied by a small persistent thread pool (measured here: ~5 GB/s on one
thread, ~8 GB/s on two, for 4 MiB pages into a strided KV tensor).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
PARALLEL_MIN_BYTES = 8 << 20  # below this, handing work to threads costs more than it saves

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


Pair = tuple[torch.Tensor, torch.Tensor] | tuple[np.ndarray, np.ndarray]


def copy_page(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for one page or one run of pages (same shape and dtype, any strides)."""
    if dst.is_cuda or src.is_cuda:
        dst.copy_(src, non_blocking=True)
        return
    copy_pages([(dst, src)])


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy view (its last dimension times its element size)."""
    return tensor.detach().view(torch.uint8).numpy()


def _host_pair(pair: Pair) -> tuple[np.ndarray, np.ndarray] | None:
    """A pair as numpy byte views; None for tensors whose last dimension is not contiguous
    (no byte view of those)."""
    if isinstance(pair[0], np.ndarray):
        return pair
    try:
        return host_bytes(pair[0]), host_bytes(pair[1])
    except RuntimeError:
        return None


def copy_pages(pairs: list[Pair]) -> None:
    """Copy every (dst, src) page or run of pages: torch tensors on any device, or numpy byte
    views of host memory (slabs.kv_blocks makes those: no torch call on a get's path); large
    CPU batches are split across the copy threads (a few large blocks cut up by their
    layers).

    Returns once every byte is in place, GPU copies included: callers commit or release the
    slots right after, and a slot released under a copy still in flight could be reused.
    """
    devices = {t.device for pair in pairs for t in pair
               if isinstance(t, torch.Tensor) and t.is_cuda}
    if devices:
        for dst, src in pairs:
            copy_page(dst, src)
        for device in devices:  # the copies were queued non-blocking on each device's stream
            torch.cuda.synchronize(device)
        return
    arrays = []
    for pair in pairs:
        as_bytes = _host_pair(pair)
        if as_bytes is None:  # strides numpy's byte views cannot express: torch copies it
            pair[0].copy_(pair[1])
        else:
            arrays.append(as_bytes)
    if COPY_THREADS == 1 or sum(src.nbytes for _, src in arrays) < PARALLEL_MIN_BYTES:
        for dst, src in arrays:
            np.copyto(dst, src)
        return
    if len(arrays) < 2 * COPY_THREADS:  # a few large blocks (runs of pages): cut each up
        arrays = [piece for dst, src in arrays for piece in _split(dst, src, COPY_THREADS)]
    shares = [arrays[i::COPY_THREADS] for i in range(COPY_THREADS)]
    list(_executor().map(_copy_share, shares))


def _split(dst: np.ndarray, src: np.ndarray, num_pieces: int) -> list[tuple]:
    """(dst, src) cut into up to `num_pieces` pairs along the first dimension that has as
    many rows (the layers of a run of pages); whole when none does."""
    for axis, size in enumerate(dst.shape):
        if size >= num_pieces:
            return list(zip(np.array_split(dst, num_pieces, axis),
                            np.array_split(src, num_pieces, axis), strict=True))
    return [(dst, src)]


def _copy_share(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="raykv-copy")
        return _pool
