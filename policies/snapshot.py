"""What the rebalancing policies see: a snapshot of the cluster, taken by the control loop.

    ClusterSnapshot
      nodes:    NodeLoad per kv node      (cumulative requests served, memory used / budget)
      prefixes: PrefixLoad per tracked prefix (cumulative requests, its page keys, holders)

Counts are cumulative: the policies turn them into rates (policies/burst.py) by difference
between snapshots, so a snapshot is cheap to take and a lost one loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

Key = bytes  # a 16-byte page key


@dataclass(frozen=True, slots=True)
class PrefixLoad:
    """One prefix that requests asked for (the directory's demand tracker)."""

    prefix_id: Key  # its deepest page key
    keys: tuple[Key, ...]  # its page keys, root first (one directory shard's share of them)
    num_requests: int  # requests whose match went through it, so far
    holders: tuple[str, ...]  # nodes holding every one of `keys`
    page_bytes: int = 0  # one page's bytes; 0 while unknown

    @property
    def num_bytes(self) -> int:
        return len(self.keys) * self.page_bytes


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """One kv node: requests served so far, and its memory tiers (device + host)."""

    node_id: str
    num_requests: int
    used_bytes: int
    capacity_bytes: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    nodes: tuple[NodeLoad, ...]
    prefixes: tuple[PrefixLoad, ...]

    def node(self, node_id: str) -> NodeLoad | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)
