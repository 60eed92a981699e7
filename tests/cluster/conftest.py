"""Cluster tier: real multi-node Ray on one machine (one raylet per simulated node), real
Redis, nodes removed for real. One Cluster per module."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster import stop
from cluster.core.tiers.memory import remove_stale_shm
from cluster.core.tiers.node_slot import slot_shm_prefix
from tests.waiting import wait_until  # noqa: F401  (re-exported for the cluster tests)

OBJECT_STORE_BYTES = 120 * 1024 * 1024


def node_args(name: str) -> dict:
    return dict(num_cpus=1, resources={"kv_node": 1, name: 1},
                object_store_memory=OBJECT_STORE_BYTES)


@pytest.fixture(scope="module")
def ray_cluster():
    """Head (C) plus workers A and B, every one a kv node; the driver runs on the head."""
    cluster = Cluster(initialize_head=True, head_node_args=node_args("node_c"))
    workers = {name: cluster.add_node(**node_args(name)) for name in ("node_a", "node_b")}
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.wait_for_nodes()
    yield cluster, workers
    try:
        stop()
    finally:
        # Even when stop() raises: a Ray left up fails every later module's start-up.
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def disk_root():
    path = tempfile.mkdtemp(prefix="raykv-cluster-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
    # A node removed for real takes its actor down without a shutdown(): unlink its slabs.
    for sub in ("", "/no-redis"):
        remove_stale_shm(slot_shm_prefix(path + sub))


def node_id_of(resource: str) -> str:
    for node in ray.nodes():
        if node["Alive"] and node["Resources"].get(resource):
            return node["NodeID"]
    raise AssertionError(f"no alive node offers {resource}")
