"""Smoke tests of the peer measurements on tiny sizes: positive, finite, bytes round-trip."""

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import redis

from cluster.tools.bench import peers
from cluster.tools.redis_server import RedisServer, redis_server_path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = 64 << 10
NUM_PAGES = 8


def _assert_gbps(value: float) -> None:
    assert isinstance(value, float) and math.isfinite(value) and value > 0, value


def test_page_pool_pages_differ_and_check_pool_catches_a_mixup():
    pool = peers.page_pool(PAGE_BYTES, NUM_PAGES)
    peers.check_pool(pool)
    assert not np.array_equal(pool[0], pool[1])
    pool[[2, 3]] = pool[[3, 2]]
    with pytest.raises(RuntimeError, match="page 2"):
        peers.check_pool(pool)


def test_memcpy_gbps():
    _assert_gbps(peers.memcpy_gbps(PAGE_BYTES, NUM_PAGES))


@pytest.mark.skipif(redis_server_path() is None, reason="redis-server not installed")
@pytest.mark.parametrize("num_connections", [1, 3])
def test_redis_gbps_round_trips_and_cleans_up(num_connections):
    with RedisServer() as server:
        result = peers.redis_gbps(server.url, PAGE_BYTES, NUM_PAGES, num_connections)
        assert set(result) == {"set", "get"}
        for value in result.values():
            _assert_gbps(value)
        client = redis.Redis.from_url(server.url)
        assert client.dbsize() == 0
        client.close()


@pytest.mark.skipif(redis_server_path() is None, reason="redis-server not installed")
def test_redis_get_fills_the_callers_buffer_with_what_was_set(monkeypatch):
    """The bytes copied into the destination are the pages that were SET (last run)."""
    copies = []
    real_copyto = np.copyto

    def spy_copyto(dst, src):
        copies.append(bytes(src))
        real_copyto(dst, src)

    monkeypatch.setattr(peers.np, "copyto", spy_copyto)
    with RedisServer() as server:
        peers.redis_gbps(server.url, PAGE_BYTES, NUM_PAGES)
    expected = peers.page_pool(PAGE_BYTES, NUM_PAGES)
    assert len(copies) == NUM_PAGES * (1 + peers.REPS)
    assert copies[-NUM_PAGES:] == [page.tobytes() for page in expected]


@pytest.mark.skipif(peers.fio_path() is None, reason="fio not installed")
@pytest.mark.parametrize(("rw", "sync_every"), [("read", 0), ("write", 0), ("write", 4)])
def test_fio_gbps_on_real_disk_deletes_its_file(monkeypatch, rw, sync_every):
    monkeypatch.setattr(peers, "FIO_RUNTIME_S", 1)
    with tempfile.TemporaryDirectory(dir="/tmp") as dir_path:
        _assert_gbps(peers.fio_gbps(dir_path, rw, 64 << 10, 2, 4 << 20, sync_every))
        assert os.listdir(dir_path) == []


def test_fio_gbps_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="rw"):
        peers.fio_gbps(str(tmp_path), "readwrite", 4096, 1, 8192)
    with pytest.raises(ValueError, match="multiple"):
        peers.fio_gbps(str(tmp_path), "read", 4096, 1, 6000)


def test_fio_gbps_without_fio_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "fio_path", lambda: None)
    with pytest.raises(RuntimeError, match="fio not found"):
        peers.fio_gbps(str(tmp_path), "read", 4096, 1, 8192)


RAY_SCRIPT = """
import ray
from cluster.tools.bench import peers
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
small = peers.ray_gbps_remote(64 << 10, 8)
large = peers.ray_gbps_remote(4 << 20, 4)  # 16 MiB: copied out on copies.COPY_THREADS threads
for name, result in (("small", small), ("large", large)):
    print(name, result["put"], result["get"])
ray.shutdown()
"""


def test_ray_gbps_in_a_subprocess():
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    proc = subprocess.run([sys.executable, "-c", RAY_SCRIPT], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[0] for line in lines] == ["small", "large"], proc.stdout
    for line in lines:
        for value in line[1:]:
            _assert_gbps(float(value))
