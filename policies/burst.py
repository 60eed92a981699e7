"""Burst detection: an EWMA of the request rate per prefix and per node, with hysteresis.

    sample_per_s = (count now - count at the last snapshot) / elapsed
    rate_per_s  += (1 - exp(-elapsed / tau_s)) * (sample_per_s - rate_per_s)

A prefix is hot from the snapshot its rate reaches its entry threshold until it falls below
its exit threshold (lower): a rate that wobbles around one threshold does not flap.

    enter = max(enter_per_s, enter_share x the rate of all tracked prefixes)
    exit  = max(exit_per_s,  exit_share  x the rate of all tracked prefixes)

so the hot set follows the traffic's scale: the prefixes that carry a real share of it, above
a floor. A node is hot while its rate is at least `node_enter_ratio` times the mean node rate
(and `node_min_per_s`), until it falls below `node_exit_ratio` times the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.snapshot import ClusterSnapshot, Key


@dataclass(frozen=True, slots=True)
class BurstSettings:
    tau_s: float = 2.0
    enter_per_s: float = 0.1
    exit_per_s: float = 0.05
    enter_share: float = 0.02
    exit_share: float = 0.01
    node_enter_ratio: float = 1.5
    node_exit_ratio: float = 1.2
    node_min_per_s: float = 2.0


@dataclass(frozen=True, slots=True)
class Rates:
    """Last cumulative counts and the EWMA rates derived from them."""

    counts: dict = field(default_factory=dict)
    rates_per_s: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BurstState:
    prefixes: Rates = Rates()
    nodes: Rates = Rates()
    hot_prefixes: frozenset = frozenset()
    hot_nodes: frozenset = frozenset()
    updated_s: float | None = None


@dataclass(frozen=True, slots=True)
class BurstPlan:
    """Rates now, what is hot, and what changed at this snapshot."""

    prefix_rates_per_s: dict[Key, float]
    node_rates_per_s: dict[str, float]
    hot_prefixes: frozenset[Key]
    hot_nodes: frozenset[str]
    started: tuple[Key, ...] = ()  # prefixes that became hot now
    ended: tuple[Key, ...] = ()  # prefixes that cooled down now


def ewma(before: Rates, counts: dict, elapsed_s: float, tau_s: float) -> Rates:
    """Rates after one more snapshot of cumulative `counts`. A name not seen before starts
    from 0 (its count so far arrived since the last snapshot); a name gone is forgotten."""
    if elapsed_s <= 0:
        return Rates(dict(counts), {k: before.rates_per_s.get(k, 0.0) for k in counts})
    alpha = 1.0 - math.exp(-elapsed_s / tau_s)
    rates = {}
    for name, count in counts.items():
        sample_per_s = max(0, count - before.counts.get(name, 0)) / elapsed_s
        rate_per_s = before.rates_per_s.get(name, 0.0)
        rates[name] = rate_per_s + alpha * (sample_per_s - rate_per_s)
    return Rates(dict(counts), rates)


def hysteresis(rates_per_s: dict, hot: frozenset, enter: float, leave: float) -> frozenset:
    """Names at or above `enter`, plus those already hot that are still at or above `leave`."""
    return frozenset(name for name, rate in rates_per_s.items()
                     if rate >= enter or (name in hot and rate >= leave))


def decide(snapshot: ClusterSnapshot, state: BurstState | None, now_s: float,
           settings: BurstSettings = BurstSettings()) -> tuple[BurstPlan, BurstState]:
    """Rates and hot sets after this snapshot. The first snapshot only sets the baseline."""
    state = state or BurstState()
    elapsed_s = 0.0 if state.updated_s is None else now_s - state.updated_s
    prefixes = ewma(state.prefixes, {p.prefix_id: p.num_requests for p in snapshot.prefixes},
                    elapsed_s, settings.tau_s)
    nodes = ewma(state.nodes, {n.node_id: n.num_requests for n in snapshot.nodes},
                 elapsed_s, settings.tau_s)
    total_per_s = sum(prefixes.rates_per_s.values())
    hot_prefixes = hysteresis(prefixes.rates_per_s, state.hot_prefixes,
                              max(settings.enter_per_s, settings.enter_share * total_per_s),
                              max(settings.exit_per_s, settings.exit_share * total_per_s))
    mean_per_s = sum(nodes.rates_per_s.values()) / max(1, len(nodes.rates_per_s))
    hot_nodes = hysteresis(
        {n: r for n, r in nodes.rates_per_s.items() if r >= settings.node_min_per_s},
        state.hot_nodes, settings.node_enter_ratio * mean_per_s,
        settings.node_exit_ratio * mean_per_s)
    plan = BurstPlan(prefixes.rates_per_s, nodes.rates_per_s, hot_prefixes, hot_nodes,
                     tuple(sorted(hot_prefixes - state.hot_prefixes)),
                     tuple(sorted(state.hot_prefixes - hot_prefixes)))
    return plan, BurstState(prefixes, nodes, hot_prefixes, hot_nodes, now_s)
