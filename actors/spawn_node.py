"""Creating a node-cache actor, pinned to its node.

Its own module, apart from actors/handles.py (which the actor classes import to call each
other) and from actors/spawn.py (which creates the controller, the one that calls this for
every kv node), so that the import graph stays acyclic.
"""

from __future__ import annotations

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.handles import NODE_NAME, NodeHandle
from actors.node_cache import NodeCacheActor
from cluster.core.config import CacheConfig


def detached_options(name: str, config: CacheConfig) -> dict:
    """Actor options for a named, detached actor in the service's namespace, reused when
    it already runs."""
    return dict(name=name, namespace=config.ray_namespace, lifetime="detached",
                get_if_exists=True)


def spawn_node(config: CacheConfig, node_id: str) -> NodeHandle:
    """The node actor of `node_id`, created pinned to that node if missing."""
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    actor = NodeCacheActor.options(**detached_options(NODE_NAME.format(node_id=node_id), config),
                                   scheduling_strategy=strategy
                                   ).remote(config.model_dump_json(), node_id)
    return NodeHandle(actor, node_id)
