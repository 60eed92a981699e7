"""Which Ray nodes hold a node actor, from `ray.nodes()`-shaped records. Pure."""

from __future__ import annotations


def kv_nodes(node_resource: str, nodes: list[dict]) -> list[str]:
    """Alive nodes that offer the kv resource or a GPU (every alive node when none does)."""
    alive = [n for n in nodes if n["Alive"]]
    chosen = [n["NodeID"] for n in alive if _offers_kv(n["Resources"], node_resource)]
    return chosen or [n["NodeID"] for n in alive]


def _offers_kv(resources: dict, node_resource: str) -> bool:
    return resources.get(node_resource, 0) > 0 or resources.get("GPU", 0) > 0


def dead_nodes(nodes: list[dict]) -> set[str]:
    return {n["NodeID"] for n in nodes if not n["Alive"]}
