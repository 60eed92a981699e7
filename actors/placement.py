"""Where node actors go: one per alive node offering the kv resource or a GPU."""

from __future__ import annotations

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.handles import NODE_NAME
from actors.node_cache import NodeCacheActor
from cluster.core.config import CacheConfig


def kv_nodes(config: CacheConfig, nodes: list[dict]) -> list[str]:
    """Alive nodes that offer the kv resource or a GPU (every alive node when none does)."""
    alive = [n for n in nodes if n["Alive"]]
    chosen = [n["NodeID"] for n in alive if _offers_kv(n["Resources"], config.node_resource)]
    return chosen or [n["NodeID"] for n in alive]


def _offers_kv(resources: dict, node_resource: str) -> bool:
    return resources.get(node_resource, 0) > 0 or resources.get("GPU", 0) > 0


def dead_nodes(nodes: list[dict]) -> set[str]:
    return {n["NodeID"] for n in nodes if not n["Alive"]}


def ensure_node_actor(config: CacheConfig, node_id: str):
    """The node actor for `node_id`, created pinned to that node if missing."""
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return NodeCacheActor.options(name=NODE_NAME.format(node_id=node_id),
                                  namespace=config.ray_namespace, lifetime="detached",
                                  get_if_exists=True, scheduling_strategy=strategy
                                  ).remote(config.model_dump_json(), node_id)
