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


def copy_page(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for one page or one run of pages (same shape and dtype, any strides)."""
    if dst.is_cuda or src.is_cuda:
        dst.copy_(src, non_blocking=True)
        return
    np.copyto(dst.detach().view(torch.uint8).numpy(), src.detach().view(torch.uint8).numpy())


def copy_pages(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every (dst, src) page or run of pages; large CPU batches are split across the
    copy threads (a few large blocks cut up by their layers).

    Returns once every byte is in place, GPU copies included: callers commit or release the
    slots right after, and a slot released under a copy still in flight could be reused.
    """
    total_bytes = sum(src.numel() * src.element_size() for _, src in pairs)
    devices = {t.device for pair in pairs for t in pair if t.is_cuda}
    if devices:
        for dst, src in pairs:
            copy_page(dst, src)
        for device in devices:  # the copies were queued non-blocking on each device's stream
            torch.cuda.synchronize(device)
        return
    if COPY_THREADS == 1 or total_bytes < PARALLEL_MIN_BYTES:
        for dst, src in pairs:
            copy_page(dst, src)
        return
    if len(pairs) < 2 * COPY_THREADS:  # a few large blocks (runs of pages): cut each up
        pairs = [piece for dst, src in pairs for piece in _split(dst, src, COPY_THREADS)]
    shares = [pairs[i::COPY_THREADS] for i in range(COPY_THREADS)]
    list(_executor().map(_copy_share, shares))


def _split(dst: torch.Tensor, src: torch.Tensor, num_pieces: int) -> list[tuple]:
    """(dst, src) cut into up to `num_pieces` pairs along the first dimension that has as
    many rows (the layers of a run of pages); whole when none does."""
    for dim, size in enumerate(dst.shape):
        if size >= num_pieces:
            return list(zip(dst.chunk(num_pieces, dim), src.chunk(num_pieces, dim),
                            strict=True))
    return [(dst, src)]


def _copy_share(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        copy_page(dst, src)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="raykv-copy")
        return _pool
