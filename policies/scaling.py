"""Scaling: how many kv nodes to ask the autoscaler for.

    pressure = mean node rate >= out_per_node_per_s  or  mean memory use >= out_memory_fraction
    idle     = mean node rate <  in_per_node_per_s   and mean memory use <  in_memory_fraction

Pressure held for `sustain_s` asks for one node more (up to `max_nodes`); idleness held as long
asks for one fewer (down to `min_nodes`). After a change nothing changes for `cooldown_s`.
The plan carries the bundles for `ray.autoscaler.sdk.request_resources(bundles=...)`: one
`{node_resource: 1}` per node wanted. The request is a floor the autoscaler keeps, so a scale-in
is a smaller request: the autoscaler removes the nodes left idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.replication import LoadView


@dataclass(frozen=True, slots=True)
class ScalingSettings:
    min_nodes: int = 1
    max_nodes: int = 0  # 0: never ask for nodes
    out_per_node_per_s: float = 50.0
    in_per_node_per_s: float = 5.0
    out_memory_fraction: float = 0.9
    in_memory_fraction: float = 0.5
    sustain_s: float = 10.0
    cooldown_s: float = 60.0
    node_resource: str = "kv_node"


@dataclass(frozen=True, slots=True)
class ScalePlan:
    num_nodes: int
    bundles: tuple[dict[str, float], ...]
    reason: str


@dataclass(frozen=True, slots=True)
class ScalingState:
    num_nodes: int | None = None  # what was last asked for
    pressure_since_s: float | None = None
    idle_since_s: float | None = None
    changed_s: float | None = None


def signals(view: LoadView, settings: ScalingSettings) -> tuple[bool, bool]:
    """(pressure, idle) of the cluster now."""
    nodes = view.snapshot.nodes
    if not nodes:
        return False, False
    rate_per_s = sum(view.burst.node_rates_per_s.get(n.node_id, 0.0) for n in nodes) / len(nodes)
    capacity_bytes = sum(n.capacity_bytes for n in nodes)
    memory = sum(n.used_bytes for n in nodes) / capacity_bytes if capacity_bytes else 0.0
    pressure = (rate_per_s >= settings.out_per_node_per_s
                or memory >= settings.out_memory_fraction)
    idle = rate_per_s < settings.in_per_node_per_s and memory < settings.in_memory_fraction
    return pressure, idle


def decide(view: LoadView, state: ScalingState | None, now_s: float,
           settings: ScalingSettings = ScalingSettings()
           ) -> tuple[ScalePlan | None, ScalingState]:
    """A new request (or None: keep the last one). One node more or fewer than the nodes
    there now, so a node asked for and not yet arrived is not asked for twice."""
    state = state or ScalingState()
    if settings.max_nodes <= 0:
        return None, state
    pressure, idle = signals(view, settings)
    pressure_since_s = _since(state.pressure_since_s, now_s) if pressure else None
    idle_since_s = _since(state.idle_since_s, now_s) if idle else None
    present = len(view.snapshot.nodes)
    cooling = state.changed_s is not None and now_s - state.changed_s < settings.cooldown_s
    wanted, reason = state.num_nodes or present, ""
    if not cooling and pressure and now_s - pressure_since_s >= settings.sustain_s:
        wanted, reason = min(settings.max_nodes, present + 1), "pressure"
    elif not cooling and idle and now_s - idle_since_s >= settings.sustain_s:
        wanted, reason = max(settings.min_nodes, present - 1), "idle"
    if wanted == (state.num_nodes or present):
        return None, ScalingState(wanted, pressure_since_s, idle_since_s, state.changed_s)
    bundles = tuple({settings.node_resource: 1.0} for _ in range(wanted))
    return ScalePlan(wanted, bundles, reason), ScalingState(wanted, None, None, now_s)


def _since(since_s: float | None, now_s: float) -> float:
    return now_s if since_s is None else since_s
