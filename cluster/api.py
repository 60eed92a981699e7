"""start() and connect(): the public entry points (see DESIGN.md, "Public client API")."""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.directory import DirectoryShard
from actors.handles import DIRECTORY_NAME, NODE_NAME, DirectoryHandle, NodeHandle
from actors.node_cache import NodeCacheActor
from cluster.config import CacheConfig
from cluster.spec import ModelSpec

log = logging.getLogger("raykv")


def _ensure_ray(config: CacheConfig) -> None:
    if not ray.is_initialized():
        # A fresh local Ray: mark this node as a kv node so a node actor lands on it.
        ray.init(resources={config.node_resource: 1}, include_dashboard=False,
                 logging_level=logging.WARNING)


def kv_nodes(config: CacheConfig) -> list[str]:
    """Alive nodes that offer the kv resource or a GPU (every node when none does)."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    chosen = [n["NodeID"] for n in alive
              if n["Resources"].get(config.node_resource, 0) > 0
              or n["Resources"].get("GPU", 0) > 0]
    return chosen or [n["NodeID"] for n in alive]


def _start_directory(config: CacheConfig) -> DirectoryHandle:
    config_json = config.model_dump_json()
    shards = [DirectoryShard.options(name=DIRECTORY_NAME.format(shard=i),
                                     namespace=config.ray_namespace, lifetime="detached",
                                     get_if_exists=True).remote(config_json, i)
              for i in range(config.num_directory_shards)]
    running = CacheConfig.model_validate_json(ray.get(shards[0].get_config.remote()))
    if running != config:
        raise ValueError("a raykv service with a different CacheConfig is already running on this "
                         f"Ray cluster: {running.model_dump()}; call stop() first")
    return DirectoryHandle(shards)


def ensure_node_actor(config: CacheConfig, node_id: str):
    """The node actor for `node_id`, created pinned to that node if missing."""
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return NodeCacheActor.options(name=NODE_NAME.format(node_id=node_id),
                                  namespace=config.ray_namespace, lifetime="detached",
                                  get_if_exists=True, scheduling_strategy=strategy
                                  ).remote(config.model_dump_json(), node_id)


def start(config: CacheConfig | None = None) -> dict:
    """Ensure the directory shards and one node actor per kv node exist; idempotent."""
    config = config or CacheConfig()
    _ensure_ray(config)
    _start_directory(config)
    nodes = kv_nodes(config)
    actors = [ensure_node_actor(config, node_id) for node_id in nodes]
    ready = ray.get([actor.ready.remote() for actor in actors])
    return {"nodes": [r["node_id"] for r in ready],
            "recovered_pages": sum(r["recovered_pages"] for r in ready)}


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
    for node_id in kv_nodes(config):
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
    for node in ray.nodes():
        handle = NodeHandle.lookup(node["NodeID"], config)
        if handle is not None:
            ray.kill(handle.actor, no_restart=True)
    for shard in DirectoryHandle.lookup(config).shards:
        ray.kill(shard, no_restart=True)
