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

from cluster.core import cpu_sets

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
    list(_executor().map(_copy_share, _balanced_shares(arrays, COPY_THREADS)))


def _balanced_shares(arrays: list[tuple[np.ndarray, np.ndarray]],
                     num_threads: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The pairs dealt to `num_threads` threads so that each copies about as many bytes:
    every block larger than an even share is cut by its layers first, then the pieces go,
    largest first, to the thread with the least so far. Dealt in turn instead, uneven runs
    of slots (a put into a full tier's scattered free slots: runs of 8, 1, 4, 2 and 1 pages)
    left one thread with most of the bytes: 17.7 GB/s against 23.2 for one run, here."""
    even_bytes = sum(src.nbytes for _, src in arrays) / num_threads
    if len(arrays) >= 8 * num_threads and max(src.nbytes for _, src in arrays) <= even_bytes / 4:
        return [arrays[i::num_threads] for i in range(num_threads)]  # many small: even in turn
    pieces = []
    for dst, src in arrays:
        if src.nbytes > even_bytes / 2:
            pieces.extend(_split(dst, src, -(-num_threads * src.nbytes // int(even_bytes))))
        else:
            pieces.append((dst, src))
    shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_threads)]
    loads = [0] * num_threads
    for dst, src in sorted(pieces, key=lambda pair: -pair[1].nbytes):
        least = loads.index(min(loads))
        shares[least].append((dst, src))
        loads[least] += src.nbytes
    return shares


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
            _pool = cpu_sets.thread_pool(COPY_THREADS, "raykv-copy")
        return _pool
