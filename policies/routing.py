"""KV-aware replica ranking: where does a request's cached prefix make prefill cheapest?

Pure: the router (cluster/serving/router.py) feeds it the directory's answer for the request's
page keys and the replicas' queue lengths, and hands the ranks to Ray Serve, which picks the
least-loaded replica within the first rank that has room.

    score(replica) = sum over the prefix's pages of the weight of the best copy the replica's
                     node can use: its own device > host > disk copy > another node's copy

A replica whose queue is longer than the shortest by more than `max_imbalance` drops to the
last rank, so a hot prefix cannot pile every request onto one replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEVICE, HOST, DISK = 0, 1, 2
TIER_WEIGHTS = {DEVICE: 1.0, HOST: 0.9, DISK: 0.6}
REMOTE_WEIGHT = 0.35  # a page another node holds: a cross-node fetch, still far below prefill
Location = tuple[str, int]  # (node_id, tier)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica_id: str
    node_id: str
    queue_len: int | None  # None: not known yet (counted as idle)


def prefix_scores(located: Sequence[Iterable[Location]], nodes: Iterable[str]) -> dict[str, float]:
    """Per node: the weighted number of prefix pages a replica there would not recompute.

    `located` has one entry per page of the longest cached prefix, each the (node, tier)
    places of that page.
    """
    # Consecutive pages stored by one put share one places object: one `best` per run.
    runs: list[list] = []  # [best weight per node, weight elsewhere, pages]
    last = None
    for places in located:
        if runs and places is last:
            runs[-1][2] += 1
            continue
        last = places
        best: dict[str, float] = {}
        for node_id, tier in places:
            weight = TIER_WEIGHTS.get(tier, 0.0)
            best[node_id] = max(best.get(node_id, 0.0), weight)
        runs.append([best, REMOTE_WEIGHT if best else 0.0, 1])
    scores: dict[str, float] = {}
    for node_id in nodes:
        total = 0.0
        for best, anywhere, num_pages in runs:
            weight = best.get(node_id, anywhere)
            for _ in range(num_pages):  # page by page, so the float sum is the same
                total += weight
        scores[node_id] = total
    return scores


def rank_replicas(replicas: Sequence[ReplicaLoad], scores: dict[str, float],
                  max_imbalance: int) -> list[list[str]]:
    """Replica ids in ranks, best first: balanced replicas by score (ties share a rank),
    then the overloaded ones. [] when there is nothing to rank."""
    if not replicas:
        return []
    loads = {r.replica_id: r.queue_len or 0 for r in replicas}
    floor = min(loads.values())
    balanced = [r for r in replicas if loads[r.replica_id] <= floor + max_imbalance]
    overloaded = [r.replica_id for r in replicas if loads[r.replica_id] > floor + max_imbalance]
    ranks: list[list[str]] = []
    for score in sorted({scores.get(r.node_id, 0.0) for r in balanced}, reverse=True):
        ranks.append([r.replica_id for r in balanced if scores.get(r.node_id, 0.0) == score])
    if overloaded:
        ranks.append(overloaded)
    return ranks


def has_hits(scores: dict[str, float]) -> bool:
    return any(score > 0 for score in scores.values())
