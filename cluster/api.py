"""start(), connect() and stop(): the public entry points (see DESIGN.md, "Public client API")."""

from __future__ import annotations

import logging
import os

import ray

from actors.handles import ControllerHandle, ControlLoopHandle, DirectoryHandle, NodeHandle
from cluster.core.config import CacheConfig
from cluster.core.geometry import PageGeometry
from cluster.core.membership import kv_nodes
from cluster.core.spec import ModelSpec
from cluster.core.store import shm_bytes_per_pool
from cluster.core.tiers.memory import SharedMemoryTooSmall, check_shm_room

log = logging.getLogger("raykv")
START_TIMEOUT_S = 120.0


def _ensure_ray(config: CacheConfig) -> None:
    """Use the Ray this process is on; else the cluster RAY_ADDRESS names; else a new local one.

    A bare ray.init() would attach to whatever cluster last ran on this machine, so a local
    start is explicit (`address="local"`), with this node marked as a kv node.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
        return
    ray.init(address="local", resources={config.node_resource: 1}, include_dashboard=False,
             logging_level=logging.WARNING)


def _check_local_shm(config: CacheConfig) -> None:
    """Fail fast, before any actor starts, when this (kv) node's /dev/shm is too small."""
    here = ray.get_runtime_context().get_node_id()
    if here in kv_nodes(config.node_resource, ray.nodes()):
        from cluster.core.pool import PoolLimits
        from cluster.core.tiers.memory import cuda_available

        limits = PoolLimits(config.device_bytes, config.host_bytes, config.disk_bytes,
                            use_cuda=cuda_available())
        check_shm_room(shm_bytes_per_pool(limits))


def start(config: CacheConfig | None = None) -> dict:
    """Ensure the directory shards, one node actor per kv node and (with
    `config.rebalance`) the control loop exist; idempotent.

    Raises ValueError when a service with another config runs, and SharedMemoryTooSmall
    (a RuntimeError) when a node's /dev/shm cannot hold the configured tiers.
    """
    config = config or CacheConfig()
    _ensure_ray(config)
    _check_local_shm(config)
    directory = DirectoryHandle.create(config)
    running = CacheConfig.model_validate_json(ray.get(directory.get_config(),
                                                      timeout=START_TIMEOUT_S))
    if running != config:
        raise ValueError("a raykv service with a different CacheConfig is already running on this "
                         f"Ray cluster: {running.model_dump()}; call stop() first")
    shards = ray.get(directory.ready(), timeout=START_TIMEOUT_S)
    controller = ControllerHandle.create(config)
    members = ray.get(controller.sync_members(), timeout=START_TIMEOUT_S)
    _raise_node_failures(members["failures"])
    if config.rebalance:
        ray.get(ControlLoopHandle.create(config).start(), timeout=START_TIMEOUT_S)
    return {"nodes": members["members"], "directory": shards}


def _raise_node_failures(failures: dict[str, str]) -> None:
    if not failures:
        return
    lines = "; ".join(f"node {node_id[:12]}: {why}" for node_id, why in failures.items())
    error = SharedMemoryTooSmall if any("shm" in why or "shared memory" in why
                                        for why in failures.values()) else RuntimeError
    raise error(f"raykv could not start on {len(failures)} node(s): {lines}")


def running_config(ray_namespace: str = "raykv") -> CacheConfig:
    ref = DirectoryHandle.first_shard_config(ray_namespace)
    if ref is None:
        raise RuntimeError("raykv is not running on this Ray cluster; call start() first")
    return CacheConfig.model_validate_json(ray.get(ref, timeout=START_TIMEOUT_S))


def connect(spec: ModelSpec, namespace: str = "default"):
    """A client for one model and tenant namespace on the running service.

    Raises TypeError/ValueError for a bad spec or an unknown namespace, ValueError when the
    node refuses the model's page geometry (past max_geometries), RuntimeError when raykv is
    not running.
    """
    from cluster.client import KVClient

    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if not ray.is_initialized():
        ray.init(address="auto", include_dashboard=False, logging_level=logging.WARNING)
    config = running_config()
    if namespace not in config.namespaces:
        raise ValueError(f"unknown namespace {namespace!r}; configured: {list(config.namespaces)}")
    home = _home_node(config)
    _open_pool(home, PageGeometry.of(spec, config.page_tokens))
    return KVClient(spec, namespace, config, DirectoryHandle.lookup(config), home)


def _open_pool(home: NodeHandle, geometry: PageGeometry) -> None:
    try:
        ray.get(home.open_pool(geometry), timeout=START_TIMEOUT_S)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error, ValueError):
            raise ValueError(str(error.cause)) from None
        raise


def _home_node(config: CacheConfig) -> NodeHandle:
    here = ray.get_runtime_context().get_node_id()
    local = NodeHandle.lookup(here, config, is_local=True)
    if local is not None:
        return local
    for node_id in kv_nodes(config.node_resource, ray.nodes()):
        remote = NodeHandle.lookup(node_id, config)
        if remote is not None:
            return remote
    raise RuntimeError("no raykv node actor is running; call start() first")


def stop(ray_namespace: str = "raykv") -> None:
    """Kill the service's actors (their shared memory is released with them)."""
    try:
        config = running_config(ray_namespace)
    except (RuntimeError, ray.exceptions.RayError):
        return
    for loop in (ControllerHandle.lookup(config), ControlLoopHandle.lookup(config)):
        if loop is not None:
            loop.kill()
    for node in ray.nodes():
        handle = NodeHandle.lookup(node["NodeID"], config)
        if handle is None:
            continue
        try:
            ray.get(handle.shutdown(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead node's slabs went with it; a restarted actor cleans up stale ones
        handle.kill()
    DirectoryHandle.lookup(config).kill()
