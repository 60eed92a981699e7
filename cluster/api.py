"""start() and connect(): the public entry points (see DESIGN.md, "Public client API")."""

from __future__ import annotations

import logging
import os

import ray

from actors.controller import Controller
from actors.directory import DirectoryShard
from actors.handles import CONTROLLER_NAME, DIRECTORY_NAME, DirectoryHandle, NodeHandle
from actors.placement import kv_nodes
from cluster.core.config import CacheConfig
from cluster.core.spec import ModelSpec

log = logging.getLogger("raykv")


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


def _start_directory(config: CacheConfig) -> DirectoryHandle:
    config_json = config.model_dump_json()
    shards = [DirectoryShard.options(name=DIRECTORY_NAME.format(shard=i),
                                     namespace=config.ray_namespace, lifetime="detached",
                                     get_if_exists=True).remote(config_json, i)
              for i in range(config.num_directory_shards)]
    running = CacheConfig.model_validate_json(ray.get(shards[0].get_config.remote()))
    ray.get([shard.ready.remote() for shard in shards])
    if running != config:
        raise ValueError("a raykv service with a different CacheConfig is already running on this "
                         f"Ray cluster: {running.model_dump()}; call stop() first")
    return DirectoryHandle(shards)


def start(config: CacheConfig | None = None) -> dict:
    """Ensure the directory shards and one node actor per kv node exist; idempotent."""
    config = config or CacheConfig()
    _ensure_ray(config)
    directory = _start_directory(config)
    controller = Controller.options(name=CONTROLLER_NAME, namespace=config.ray_namespace,
                                    lifetime="detached", get_if_exists=True
                                    ).remote(config.model_dump_json())
    nodes = ray.get(controller.sync_members.remote())
    return {"nodes": nodes, "directory": ray.get([s.ready.remote() for s in directory.shards])}


def running_config(ray_namespace: str = "raykv") -> CacheConfig:
    try:
        shard = ray.get_actor(DIRECTORY_NAME.format(shard=0), namespace=ray_namespace)
    except ValueError:
        raise RuntimeError("raykv is not running on this Ray cluster; call start() first") from None
    return CacheConfig.model_validate_json(ray.get(shard.get_config.remote()))


def connect(spec: ModelSpec, namespace: str = "default"):
    """A client for one model and tenant namespace on the running service."""
    from cluster.client import KVClient

    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if not ray.is_initialized():
        ray.init(address="auto", include_dashboard=False, logging_level=logging.WARNING)
    config = running_config()
    if namespace not in config.namespaces:
        raise ValueError(f"unknown namespace {namespace!r}; configured: {list(config.namespaces)}")
    directory = DirectoryHandle.lookup(config)
    return KVClient(spec, namespace, config, directory, _home_node(config))


def _home_node(config: CacheConfig) -> NodeHandle:
    here = ray.get_runtime_context().get_node_id()
    local = NodeHandle.lookup(here, config, is_local=True)
    if local is not None:
        return local
    for node_id in kv_nodes(config, ray.nodes()):
        remote = NodeHandle.lookup(node_id, config)
        if remote is not None:
            return remote
    raise RuntimeError("no raykv node actor is running; call start() first")


def stop(ray_namespace: str = "raykv") -> None:
    """Kill the service's actors (their shared memory is released with them)."""
    try:
        config = running_config(ray_namespace)
    except RuntimeError:
        return
    try:
        ray.kill(ray.get_actor(CONTROLLER_NAME, namespace=ray_namespace), no_restart=True)
    except ValueError:
        pass
    for node in ray.nodes():
        handle = NodeHandle.lookup(node["NodeID"], config)
        if handle is None:
            continue
        try:
            ray.get(handle.actor.shutdown.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead node's slabs went with it; a restarted actor cleans up stale ones
        ray.kill(handle.actor, no_restart=True)
    for shard in DirectoryHandle.lookup(config).shards:
        ray.kill(shard, no_restart=True)
