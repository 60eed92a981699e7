"""The disk's own latency and bandwidth, read with plain O_DIRECT preadv (no raykv code): the
machine's limits that the paging-tax model is built from.

Both read a file region that holds written data: on ext4 and xfs a fallocated but unwritten
extent reads back as zeros without touching the disk, which would flatter both figures.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cluster.core.tiers.aligned import ALIGN_BYTES, aligned_empty

LATENCY_SAMPLES = 64
BANDWIDTH_BLOCK_BYTES = 4 << 20
BANDWIDTH_MIN_S = 0.25


def _open_direct(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0) | os.O_CLOEXEC)


def read_latency_s(path: str, region_bytes: int, seed: int = 0) -> float:
    """Median time of one 4096-byte read at a random aligned offset of the first
    `region_bytes` of `path`, one at a time (queue depth 1)."""
    num_blocks = region_bytes // ALIGN_BYTES
    if num_blocks <= 0:
        raise ValueError(f"region_bytes must hold a block of {ALIGN_BYTES}, got {region_bytes}")
    offsets = np.random.default_rng(seed).integers(0, num_blocks, LATENCY_SAMPLES) * ALIGN_BYTES
    buffer = aligned_empty(ALIGN_BYTES)
    fd = _open_direct(path)
    try:
        times_s = []
        for offset in offsets.tolist():
            start_s = time.perf_counter()
            os.preadv(fd, [buffer], offset)
            times_s.append(time.perf_counter() - start_s)
    finally:
        os.close(fd)
    return statistics.median(times_s)


def read_bandwidth_bytes_per_s(path: str, region_bytes: int, num_threads: int) -> float:
    """Bytes per second reading the first `region_bytes` of `path` in 4 MiB blocks spread over
    `num_threads` threads (one buffer each), pass after pass for at least BANDWIDTH_MIN_S
    (at least one whole pass)."""
    block_bytes = min(BANDWIDTH_BLOCK_BYTES, region_bytes // ALIGN_BYTES * ALIGN_BYTES)
    if block_bytes <= 0:
        raise ValueError(f"region_bytes must hold a block of {ALIGN_BYTES}, got {region_bytes}")
    offsets = list(range(0, region_bytes - block_bytes + 1, block_bytes))
    buffers = [aligned_empty(block_bytes) for _ in range(num_threads)]
    fd = _open_direct(path)

    def read_share(thread: int) -> int:
        return sum(os.preadv(fd, [buffers[thread]], offset)
                   for offset in offsets[thread::num_threads])

    try:
        with ThreadPoolExecutor(num_threads) as pool:
            num_bytes, elapsed_s, start_s = 0, 0.0, time.perf_counter()
            while elapsed_s < BANDWIDTH_MIN_S:
                num_bytes += sum(pool.map(read_share, range(num_threads)))
                elapsed_s = time.perf_counter() - start_s
    finally:
        os.close(fd)
    return num_bytes / elapsed_s
