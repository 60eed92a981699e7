"""raykv's control loop in the cluster simulator: the service's rebalancing policy
(policies/rebalance.py: burst detection, replication, migration; scaling is planned but the
simulated cluster keeps its N) on snapshots taken as actors/control_loop.py takes them.

Every `period_s` of simulated time (CacheConfig.rebalance_period_s), from the first arrival on,
on its own clock: at each arrival, every pass due by then runs at its own time, after the
prefills finished by that time have put their pages (so an idle stretch gets its passes too):

    snapshot   NodeLoad per node: requests it served pages to (own and remote), device + host
               pages held against their capacity; PrefixLoad per shard's SNAPSHOT_PREFIXES
               most demanded prefixes (the shard's PrefixDemand, which its lookups feed), with
               their holders (DirectoryIndex.holders, its answers kept until one of the
               prefix's keys changes hands: sim_holders.py) and page bytes
    decide     rebalance.decide(snapshot, state, now_s)
    apply      a copy: the target puts the pages its source holds (cross-node bytes counted);
               a move: the target (if any) puts them, then the source discards them

Copies and moves land at once: their transfer time is not modelled, nor the NIC they share.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.core.geometry import DEVICE, HOST
from policies import rebalance
from policies.snapshot import ClusterSnapshot, NodeLoad, PrefixLoad

SNAPSHOT_PREFIXES = 64  # per shard, as actors/control_loop.py asks
Policy = Callable[[ClusterSnapshot, object, float], tuple]


class SimControlLoop:
    """Called by SimCluster.serve with each arrival's time (see module doc)."""

    def __init__(self, period_s: float = 0.5, policy: Policy = rebalance.decide) -> None:
        self.period_s = period_s
        self.policy = policy
        self.state = None
        self.start_s: float | None = None
        self.next_s: float | None = None  # the next pass's time
        self.ticks = 0  # passes run
        self.counters = {"passes": 0, "copies": 0, "moves": 0, "drops": 0, "copied_pages": 0,
                         "dropped_pages": 0, "bytes": 0}

    def __call__(self, cluster, now_s: float) -> None:
        """Every pass due by `now_s`, each at its own time (after cluster.complete(then))."""
        if self.start_s is None:
            self.start_s = self.next_s = now_s
        while self.next_s <= now_s:
            tick_s = self.next_s
            cluster.complete(tick_s)
            self._pass(cluster, tick_s)
            self.ticks += 1
            # on a grid from the first arrival (no drift from summing the period)
            self.next_s = self.start_s + self.ticks * self.period_s

    def _pass(self, cluster, now_s: float) -> None:
        plan, self.state = self.policy(snapshot(cluster), self.state, now_s)
        self.counters["passes"] += 1
        for copy in plan.copies:
            self._pull(cluster, copy.source, copy.target, copy.keys)
            self.counters["copies"] += 1
        for move in plan.moves:
            self._move(cluster, move)

    def _pull(self, cluster, source: str, target: str, keys) -> int:
        held = cluster.nodes[cluster.index_of[source]].tier_of
        pages = [k for k in keys if k in held]
        node = cluster.index_of[target]
        stored = cluster.nodes[node].put(pages)
        cluster.sync_node(node)
        self.counters["copied_pages"] += stored
        self.counters["bytes"] += stored * cluster.page_bytes
        return stored

    def _move(self, cluster, move) -> None:
        if move.target is not None:
            self._pull(cluster, move.source, move.target, move.keys)
        node = cluster.index_of[move.source]
        self.counters["dropped_pages"] += cluster.nodes[node].discard(move.keys)
        cluster.sync_node(node)
        self.counters["moves" if move.target else "drops"] += 1


def snapshot(cluster) -> ClusterSnapshot:
    """What the control loop sees of the simulated cluster."""
    memory = cluster.capacities[DEVICE] + cluster.capacities[HOST]
    nodes = tuple(NodeLoad(node_id, cluster.gets[i],
                           (node.counts[DEVICE] + node.counts[HOST]) * cluster.page_bytes,
                           memory * cluster.page_bytes)
                  for i, (node_id, node) in enumerate(zip(cluster.node_ids, cluster.nodes,
                                                          strict=True)))
    prefixes = []
    directory = cluster.directory
    for index, demand in enumerate(directory.demand):
        top = demand.top(SNAPSHOT_PREFIXES)
        directory.holders.keep_only(index, (key for key, _, _ in top))
        # The shard's DirectoryIndex.holders(keys), kept while none of its keys changes hands
        prefixes.extend(PrefixLoad(key, keys, num_requests,
                                   directory.holders.answer(index, key, keys),
                                   cluster.page_bytes)
                        for key, keys, num_requests in top)
    return ClusterSnapshot(nodes, tuple(prefixes))
