"""Machine limits and peers that raykv benchmarks are compared against. All return GB/s (1e9 B/s).

Every contender does the same work: the page's bytes end up in a buffer the caller owns, a
preallocated numpy array that is already touched (page faults are not measured; a fresh
buffer fills ~3x slower here). A zero-copy view into a store is not a get, so Ray's get is
followed by a copy, made with raykv's own copy routine and threads (copy_rows); Redis can be
given as many connections as raykv's get has copy threads. With a page_shape, a get fills the
same strided layout raykv's get fills (kv_windows). Each result is the median of REPS
timed runs after one warm-up run; the destination is checked against the source after the last
run (outside the timing).

Page contents: page i = BASE ^ (i & 0xFF), BASE a fixed byte ramp, so a mixed-up page is caught.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable
from itertools import repeat

import numpy as np

REPS = 5
FIO_RUNTIME_S = 3
FIO_RW = {"read": "randread", "write": "randwrite"}


def _base_page(page_bytes: int) -> np.ndarray:
    return (np.arange(page_bytes, dtype=np.uint32) % 251).astype(np.uint8)


def page_pool(page_bytes: int, num_pages: int) -> np.ndarray:
    """A touched [num_pages, page_bytes] uint8 pool holding the reference contents."""
    pool = np.empty((num_pages, page_bytes), dtype=np.uint8)
    base = _base_page(page_bytes)
    for i in range(num_pages):
        np.bitwise_xor(base, np.uint8(i & 0xFF), out=pool[i])
    return pool


def touched_buffer(page_bytes: int, num_pages: int) -> np.ndarray:
    """A [num_pages, page_bytes] uint8 destination whose pages are already faulted in."""
    buf = np.empty((num_pages, page_bytes), dtype=np.uint8)
    buf.fill(0xA5)
    return buf


def kv_windows(page_bytes: int, num_pages: int,
               page_shape: tuple[int, ...] | None = None) -> list[np.ndarray]:
    """Where a get puts page i: with page_shape (a page's uint8 shape [L, 2, H, T, D bytes]),
    tokens i*T.. of a touched [L, 2, H, num_pages * T, D bytes] buffer, laid out as raykv's
    get fills `out` (strided windows); without, row i of a touched_buffer."""
    if page_shape is None:
        return list(touched_buffer(page_bytes, num_pages))
    *outer, page_tokens, row_bytes = page_shape
    buffer = np.empty((*outer, num_pages * page_tokens, row_bytes), dtype=np.uint8)
    buffer.fill(0xA5)
    return [buffer[..., i * page_tokens:(i + 1) * page_tokens, :] for i in range(num_pages)]


def check_pool(pool) -> None:
    """Raise RuntimeError unless pool (rows, or kv_windows) holds the reference contents
    (see page_pool), page i's bytes in C order."""
    base = _base_page(pool[0].size)
    for i, page in enumerate(pool):
        if not np.array_equal(page.reshape(-1), base ^ np.uint8(i & 0xFF)):
            raise RuntimeError(f"page {i} holds different bytes than were stored")


def median_gbps(run_s: Callable[[], float], total_bytes: int) -> float:
    """Warm up once, then total_bytes / median of REPS runs (run_s returns its timed seconds)."""
    run_s()
    times_s = [run_s() for _ in range(REPS)]
    return total_bytes / statistics.median(times_s) / 1e9


def memcpy_gbps(page_bytes: int, num_pages: int) -> float:
    """np.copyto page by page from a touched source pool into a touched destination pool."""
    src, dst = page_pool(page_bytes, num_pages), touched_buffer(page_bytes, num_pages)

    def run() -> None:
        for i in range(num_pages):
            np.copyto(dst[i], src[i])

    gbps = median_gbps(lambda: _timed_s(run), page_bytes * num_pages)
    check_pool(dst)
    return gbps


def fio_path() -> str | None:
    """The `fio` executable on PATH (or /usr/bin), or None."""
    return shutil.which("fio") or shutil.which("fio", path="/usr/bin")


def _fio_argv(file_path: str, rw: str, block_bytes: int, num_jobs: int, size_bytes: int,
              sync_every: int) -> list[str]:
    sync = [f"--fdatasync={sync_every}"] if sync_every else []
    return [fio_path(), "--name=raykv-peer", f"--filename={file_path}", f"--rw={FIO_RW[rw]}",
            f"--bs={block_bytes}", f"--size={size_bytes}", f"--numjobs={num_jobs}",
            "--direct=1", "--ioengine=psync", "--group_reporting", "--output-format=json",
            "--time_based", f"--runtime={FIO_RUNTIME_S}", "--randrepeat=0", *sync]


def _run_fio_json(argv: list[str]) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=FIO_RUNTIME_S + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def fio_gbps(dir_path: str, rw: str, block_bytes: int, num_jobs: int, size_bytes: int,
             sync_every: int = 0) -> float:
    """fio O_DIRECT psync bandwidth on a size_bytes file in dir_path (a real disk, not tmpfs).

    rw "read" runs randread and "write" randwrite: a slab cache reads and writes slots at
    scattered, block-aligned offsets, not as one stream (at >= 1 MiB blocks the two are
    about equal on NVMe anyway). num_jobs threads share one file; before a read, fio lays
    the file out (untimed); each run is time-based for FIO_RUNTIME_S. The file is deleted.
    sync_every > 0 (writes): each job fdatasyncs after every sync_every of its writes
    (--fdatasync), the limit of durable writes at that block size and queue depth.
    """
    if fio_path() is None:
        raise RuntimeError("fio not found on PATH; install fio (apt fio)")
    if rw not in FIO_RW:
        raise ValueError(f"rw must be one of {sorted(FIO_RW)}, got {rw!r}")
    if size_bytes < block_bytes or size_bytes % block_bytes:
        raise ValueError(f"size_bytes {size_bytes} must be a multiple of block_bytes {block_bytes}")
    file_path = os.path.join(dir_path, f"raykv-fio-{uuid.uuid4().hex}.dat")
    try:
        report = _run_fio_json(_fio_argv(file_path, rw, block_bytes, num_jobs, size_bytes,
                                          sync_every))
    finally:
        if os.path.exists(file_path):
            os.remove(file_path)
    return report["jobs"][0]["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def _redis_client(url: str):
    import redis
    import redis.utils

    if not redis.utils.HIREDIS_AVAILABLE:
        raise RuntimeError("redis-py without hiredis would understate Redis; pip install hiredis")
    return redis.Redis.from_url(url)


def redis_gbps(url: str, page_bytes: int, num_pages: int, num_connections: int = 1,
               page_shape: tuple[int, ...] | None = None) -> dict[str, float]:
    """{"set", "get"}: pipelined SETs of num_pages pages, then pipelined GETs copied into a
    touched buffer, as redis-py's docs recommend for bulk (one pipeline per connection, no
    transaction, hiredis). The pages are split over num_connections connections, each in
    its own thread (page i on connection i % num_connections), so that Redis gets as many
    connections as the contender it stands against has threads; each thread copies its own
    pages out with np.copyto, into kv_windows(..., page_shape). Keys are raykv:peer:<uuid>:<i>,
    deleted afterwards.
    """
    from concurrent.futures import ThreadPoolExecutor

    clients = [_redis_client(url) for _ in range(num_connections)]
    src, dst = page_pool(page_bytes, num_pages), kv_windows(page_bytes, num_pages, page_shape)
    keys = [f"raykv:peer:{uuid.uuid4().hex}:{i}" for i in range(num_pages)]
    shares = [range(c, num_pages, num_connections) for c in range(num_connections)]

    pool = ThreadPoolExecutor(num_connections)

    def on_every_connection(move: Callable, pages) -> Callable[[], float]:
        """Time `move` of each connection's share of the pages, all connections at once."""
        return lambda: _timed_s(lambda: list(pool.map(move, clients, repeat(keys),
                                                      repeat(pages), shares)))

    try:
        result = {"set": median_gbps(on_every_connection(_set_share, src), src.nbytes),
                  "get": median_gbps(on_every_connection(_get_share, dst), src.nbytes)}
        check_pool(dst)
    finally:
        pool.shutdown()
        clients[0].delete(*keys)
        for client in clients:
            client.close()
    return result


def _set_share(client, keys: list[str], src, share: range) -> None:
    """SET the pages of `share` from `src`, in one pipeline."""
    pipe = client.pipeline(transaction=False)
    for i in share:
        pipe.set(keys[i], memoryview(src[i]))
    pipe.execute()


def _get_share(client, keys: list[str], dst, share: range) -> None:
    """GET the pages of `share` in one pipeline, each copied into its window of `dst`."""
    pipe = client.pipeline(transaction=False)
    for i in share:
        pipe.get(keys[i])
    for i, value in zip(share, pipe.execute(), strict=True):
        np.copyto(dst[i], np.frombuffer(value, dtype=np.uint8).reshape(dst[i].shape))


def _timed_s(run: Callable[[], object]) -> float:
    start_s = time.perf_counter()
    run()
    return time.perf_counter() - start_s


class RedisExists:
    """A directory lookup done with Redis: the keys SET once; a lookup is one pipeline of
    EXISTS, one per key (Redis has no prefix walk, so every key is checked), then the
    longest prefix of keys present. Keys are raykv:peer:<uuid>:<key hex>, deleted on close."""

    def __init__(self, url: str, keys: list[bytes]) -> None:
        self.client = _redis_client(url)
        prefix = f"raykv:peer:{uuid.uuid4().hex}:".encode()
        self.keys = [prefix + key.hex().encode() for key in keys]
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.set(key, b"1")
        pipe.execute()

    def longest_prefix(self) -> int:
        """How many leading keys are present, in pages."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.exists(key)
        found = 0
        for present in pipe.execute():
            if not present:
                break
            found += 1
        return found

    def close(self) -> None:
        self.client.delete(*self.keys)
        self.client.close()


def _ray_put_gbps(src: np.ndarray) -> tuple[float, list]:
    """ray.put GB/s of each page of src, and the refs of the last run (kept alive)."""
    import ray

    refs: list = []

    def put_s() -> float:
        refs.clear()  # frees the previous run's objects, outside the timing
        start_s = time.perf_counter()
        refs.extend(ray.put(page) for page in src)
        return time.perf_counter() - start_s

    return median_gbps(put_s, src.nbytes), refs


def copy_rows(dst: list[np.ndarray], pages: list[np.ndarray]) -> None:
    """dst[i] = pages[i] (reshaped) for each page, with raykv's own copy routine and threads
    (copies.copy_pages: np.copyto per page, a batch >= 8 MiB split over its thread pool), so
    that a peer's copy out is as parallel as raykv's get."""
    import warnings

    import torch

    from cluster.core.copies import copy_pages

    with warnings.catch_warnings():  # a read-only (plasma) page: only ever read here
        warnings.simplefilter("ignore", UserWarning)
        pairs = [(torch.from_numpy(row), torch.from_numpy(page.reshape(row.shape)))
                 for row, page in zip(dst, pages, strict=True)]
    copy_pages(pairs)


def _ray_get_gbps(refs: list, page_bytes: int, num_pages: int,
                  page_shape: tuple[int, ...] | None) -> float:
    import ray

    dst = kv_windows(page_bytes, num_pages, page_shape)
    gbps = median_gbps(lambda: _timed_s(lambda: copy_rows(dst, ray.get(refs))),
                       page_bytes * num_pages)
    check_pool(dst)
    return gbps


def ray_gbps_remote(page_bytes: int, num_pages: int,
                    page_shape: tuple[int, ...] | None = None) -> dict[str, float]:
    """{"put", "get"} as a same-node client would see them: the driver puts, a worker gets.

    The get runs in a Ray task (another worker process) pinned to this node, so it reads
    the driver's objects from the local plasma store, as a raykv client on this node would:
    one ray.get of every page's ref, then copy_rows into kv_windows(..., page_shape).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    src = page_pool(page_bytes, num_pages)
    put, refs = _ray_put_gbps(src)
    del src
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    remote_get = ray.remote(num_cpus=0, scheduling_strategy=here)(_ray_get_gbps)
    # refs inside a list are passed as refs, not resolved, so the worker times its own get
    get = ray.get(remote_get.remote(refs, page_bytes, num_pages, page_shape))
    return {"put": put, "get": get}
