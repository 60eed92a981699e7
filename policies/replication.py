"""Replication: copy hot prefixes, ahead of demand, to nodes with room for them.

For each hot prefix, hottest first:

    wanted copies = clamp(ceil(rate / per_copy_per_s), min_copies, number of nodes)
    targets       = nodes without a copy (nor one on its way) whose hot set still fits in
                    `max_hot_fraction` of their memory, least loaded first
    source        = the least loaded holder (it serves the export)

so a router can spread a hot prefix over several replicas, each reading it locally. A copy
planned but not yet seen in the directory is not planned again until `retry_s` passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.burst import BurstPlan
from policies.snapshot import ClusterSnapshot, Key, PrefixLoad


@dataclass(frozen=True, slots=True)
class ReplicationSettings:
    per_copy_per_s: float = 0.5
    min_copies: int = 2
    max_hot_fraction: float = 0.6
    retry_s: float = 5.0
    max_copies_per_step: int = 16


@dataclass(frozen=True, slots=True)
class Replicate:
    """`target` pulls `keys` (the prefix's pages) from `source`."""

    prefix_id: Key
    keys: tuple[Key, ...]
    source: str
    target: str


@dataclass(frozen=True, slots=True)
class LoadView:
    """A snapshot and the burst detector's reading of it: what every rebalancing policy sees."""

    snapshot: ClusterSnapshot
    burst: BurstPlan


@dataclass(frozen=True, slots=True)
class ReplicationState:
    planned: dict = field(default_factory=dict)  # (prefix_id, target) -> when planned (s)


def hot_bytes(view: LoadView) -> dict[str, int]:
    """Per node: bytes of the hot prefixes it holds (shared pages counted once per prefix)."""
    held = {n.node_id: 0 for n in view.snapshot.nodes}
    for prefix in view.snapshot.prefixes:
        if prefix.prefix_id in view.burst.hot_prefixes:
            for node_id in prefix.holders:
                if node_id in held:
                    held[node_id] += prefix.num_bytes
    return held


def decide(view: LoadView, state: ReplicationState | None, now_s: float,
           settings: ReplicationSettings = ReplicationSettings()
           ) -> tuple[tuple[Replicate, ...], ReplicationState]:
    """The copies to make now, and the copies on their way."""
    state = state or ReplicationState()
    planned = {(p, t): at_s for (p, t), at_s in state.planned.items()
               if now_s - at_s < settings.retry_s and not _holds(view, p, t)}
    used = hot_bytes(view)
    rates = view.burst.prefix_rates_per_s
    hot = sorted((p for p in view.snapshot.prefixes if p.prefix_id in view.burst.hot_prefixes
                  and p.holders), key=lambda p: (-rates.get(p.prefix_id, 0.0), p.prefix_id))
    copies: list[Replicate] = []
    for prefix in hot:
        for target in _targets(view, prefix, planned, used, settings):
            if len(copies) >= settings.max_copies_per_step:
                break
            copies.append(Replicate(prefix.prefix_id, prefix.keys, _source(view, prefix),
                                    target))
            planned[(prefix.prefix_id, target)] = now_s
            used[target] += prefix.num_bytes
    return tuple(copies), ReplicationState(planned)


def _holds(view: LoadView, prefix_id: Key, node_id: str) -> bool:
    return any(p.prefix_id == prefix_id and node_id in p.holders for p in view.snapshot.prefixes)


def _load(view: LoadView, node_id: str) -> float:
    return view.burst.node_rates_per_s.get(node_id, 0.0)


def _source(view: LoadView, prefix: PrefixLoad) -> str:
    return min(prefix.holders, key=lambda n: (_load(view, n), n))


def _targets(view: LoadView, prefix: PrefixLoad, planned: dict, used: dict[str, int],
             settings: ReplicationSettings) -> list[str]:
    nodes = view.snapshot.nodes
    rate_per_s = view.burst.prefix_rates_per_s.get(prefix.prefix_id, 0.0)
    wanted = min(len(nodes), max(settings.min_copies,
                                 math.ceil(rate_per_s / settings.per_copy_per_s)))
    copies = set(prefix.holders) | {t for (p, t) in planned if p == prefix.prefix_id}
    room = [n for n in nodes if n.node_id not in copies
            and used[n.node_id] + prefix.num_bytes
            <= settings.max_hot_fraction * n.capacity_bytes]
    room.sort(key=lambda n: (_load(view, n.node_id), used[n.node_id], n.node_id))
    return [n.node_id for n in room[: max(0, wanted - len(copies))]]
