"""Machine limits and peers that raykv benchmarks are compared against. All return GB/s (1e9 B/s).

Every contender does the same work: the page's bytes end up in a buffer the caller owns, a
preallocated numpy array that is already touched (page faults are not measured; a fresh
buffer fills ~3x slower here). A zero-copy view into a store is not a get, so Ray's get is
followed by a copy. Each result is the median of REPS timed runs after one warm-up run; the
destination is checked against the source after the last run (outside the timing).

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


def check_pool(pool: np.ndarray) -> None:
    """Raise RuntimeError unless pool holds the reference contents (see page_pool)."""
    base = _base_page(pool.shape[1])
    for i in range(pool.shape[0]):
        if not np.array_equal(pool[i], base ^ np.uint8(i & 0xFF)):
            raise RuntimeError(f"page {i} holds different bytes than were stored")


def median_gbps(run_s: Callable[[], float], total_bytes: int) -> float:
    """Warm up once, then total_bytes / median of REPS runs (run_s returns its timed seconds)."""
    run_s()
    times_s = [run_s() for _ in range(REPS)]
    return total_bytes / statistics.median(times_s) / 1e9


def memcpy_gbps(page_bytes: int, num_pages: int) -> float:
    """np.copyto page by page from a touched source pool into a touched destination pool."""
    src, dst = page_pool(page_bytes, num_pages), touched_buffer(page_bytes, num_pages)

    def run_s() -> float:
        start_s = time.perf_counter()
        for i in range(num_pages):
            np.copyto(dst[i], src[i])
        return time.perf_counter() - start_s

    gbps = median_gbps(run_s, page_bytes * num_pages)
    check_pool(dst)
    return gbps


def fio_path() -> str | None:
    """The `fio` executable on PATH (or /usr/bin), or None."""
    return shutil.which("fio") or shutil.which("fio", path="/usr/bin")


def _fio_argv(file_path: str, rw: str, block_bytes: int, num_jobs: int, size_bytes: int):
    return [fio_path(), "--name=raykv-peer", f"--filename={file_path}", f"--rw={FIO_RW[rw]}",
            f"--bs={block_bytes}", f"--size={size_bytes}", f"--numjobs={num_jobs}",
            "--direct=1", "--ioengine=psync", "--group_reporting", "--output-format=json",
            "--time_based", f"--runtime={FIO_RUNTIME_S}", "--randrepeat=0"]


def _run_fio_json(argv: list[str]) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=FIO_RUNTIME_S + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def fio_gbps(dir_path: str, rw: str, block_bytes: int, num_jobs: int, size_bytes: int) -> float:
    """fio O_DIRECT psync bandwidth on a size_bytes file in dir_path (a real disk, not tmpfs).

    rw "read" runs randread and "write" randwrite: a slab cache reads and writes slots at
    scattered, block-aligned offsets, not as one stream (at >= 1 MiB blocks the two are
    about equal on NVMe anyway). num_jobs threads share one file; before a read, fio lays
    the file out (untimed); each run is time-based for FIO_RUNTIME_S. The file is deleted.
    """
    if fio_path() is None:
        raise RuntimeError("fio not found on PATH; install fio (apt fio)")
    if rw not in FIO_RW:
        raise ValueError(f"rw must be one of {sorted(FIO_RW)}, got {rw!r}")
    if size_bytes < block_bytes or size_bytes % block_bytes:
        raise ValueError(f"size_bytes {size_bytes} must be a multiple of block_bytes {block_bytes}")
    file_path = os.path.join(dir_path, f"raykv-fio-{uuid.uuid4().hex}.dat")
    try:
        report = _run_fio_json(_fio_argv(file_path, rw, block_bytes, num_jobs, size_bytes))
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


def redis_gbps(url: str, page_bytes: int, num_pages: int) -> dict[str, float]:
    """{"set", "get"}: pipelined SET of num_pages pages, then pipelined GET copied into a buffer.

    Keys are raykv:peer:<uuid>:<i>, deleted afterwards. One connection, no transaction.
    """
    client = _redis_client(url)
    src, dst = page_pool(page_bytes, num_pages), touched_buffer(page_bytes, num_pages)
    keys = [f"raykv:peer:{uuid.uuid4().hex}:{i}" for i in range(num_pages)]

    def set_s() -> float:
        start_s = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for key, page in zip(keys, src, strict=True):
            pipe.set(key, memoryview(page))
        pipe.execute()
        return time.perf_counter() - start_s

    def get_s() -> float:
        start_s = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        for i, value in enumerate(pipe.execute()):
            np.copyto(dst[i], np.frombuffer(value, dtype=np.uint8))
        return time.perf_counter() - start_s

    try:
        result = {"set": median_gbps(set_s, src.nbytes), "get": median_gbps(get_s, dst.nbytes)}
        check_pool(dst)
    finally:
        client.delete(*keys)
        client.close()
    return result


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


def ray_gbps(page_bytes: int, num_pages: int) -> dict[str, float]:
    """{"put", "get"} in this process; the caller has called ray.init.

    put = ray.put of each page (a numpy array); get = ray.get of all refs, then np.copyto
    of each (zero-copy plasma view) into a touched buffer.
    """
    src = page_pool(page_bytes, num_pages)
    put, refs = _ray_put_gbps(src)
    del src
    return {"put": put, "get": _ray_get_gbps(refs, page_bytes, num_pages)}


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


def _ray_get_gbps(refs: list, page_bytes: int, num_pages: int) -> float:
    import ray

    dst = touched_buffer(page_bytes, num_pages)

    def get_s() -> float:
        start_s = time.perf_counter()
        for i, page in enumerate(ray.get(refs)):
            np.copyto(dst[i], page)
        return time.perf_counter() - start_s

    gbps = median_gbps(get_s, dst.nbytes)
    check_pool(dst)
    return gbps


def ray_gbps_remote(page_bytes: int, num_pages: int) -> dict[str, float]:
    """{"put", "get"} as a same-node client would see them: the driver puts, a worker gets.

    The get runs in a Ray task (another worker process) pinned to this node, so it reads
    the driver's objects from the local plasma store, as a raykv client on this node would.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    src = page_pool(page_bytes, num_pages)
    put, refs = _ray_put_gbps(src)
    del src
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    remote_get = ray.remote(num_cpus=0, scheduling_strategy=here)(_ray_get_gbps)
    # refs inside a list are passed as refs, not resolved, so the worker times its own get
    get = ray.get(remote_get.remote(refs, page_bytes, num_pages))
    return {"put": put, "get": get}
