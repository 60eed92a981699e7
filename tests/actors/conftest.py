"""Actor tier: one local Ray per module (start-up costs seconds); GPUs are only labels."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import ray

from cluster import CacheConfig, start, stop
from cluster.core.tiers.memory import remove_stale_shm
from cluster.core.tiers.node_slot import slot_shm_prefix


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, num_gpus=2, resources={"kv_node": 1},
             include_dashboard=False,
             object_store_memory=200 * 1024 * 1024, logging_level="WARNING",
             _system_config={"metrics_report_interval_ms": 1000})
    yield
    try:
        stop()
    finally:
        # Even when stop() raises: a Ray left up here fails every later module's ray.init
        # ("called ray.init twice"), hiding the one error behind a dozen (CI on bdf0779).
        ray.shutdown()


@pytest.fixture(scope="module")
def disk_root():
    # /tmp is the real disk here; O_DIRECT needs one (tmpfs is not).
    path = tempfile.mkdtemp(prefix="raykv-test-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
    # A node actor killed for real leaves its slabs; a later service under another disk dir
    # has another shm prefix and would not reclaim them.
    remove_stale_shm(slot_shm_prefix(path))


@pytest.fixture(scope="module")
def service(ray_local, disk_root):
    """Start raykv with a config; a different config restarts it."""

    def _start(**overrides) -> CacheConfig:
        # A fresh disk dir per service: a restarted service would otherwise (rightly)
        # recover the previous one's disk pages. The node slots (and their shm prefix) stay
        # under disk_root, so slabs of a killed actor are reclaimed by the next one.
        settings = dict(page_tokens=16, device_bytes=64 * 8192, host_bytes=64 * 8192,
                        disk_bytes=1 << 20, disk_dir=disk_root)
        settings.update(overrides)
        config = CacheConfig(**settings)
        stop()
        shutil.rmtree(disk_root, ignore_errors=True)
        start(config)
        return config

    return _start
