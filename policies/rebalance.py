"""The control loop's policy: burst detection, then replication, migration and scaling on its
reading of the snapshot.

    snapshot --burst.decide--> rates, hot prefixes and nodes --+--> replication.decide -> copies
                                                               +--> migration.decide   -> moves
                                                               +--> scaling.decide     -> request

Each piece is a pure decide(snapshot, state, now_s) -> (plan, state); so is the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies import burst, migration, replication, scaling
from policies.burst import BurstPlan, BurstSettings, BurstState
from policies.migration import MigrationSettings, MigrationState, Move
from policies.replication import LoadView, Replicate, ReplicationSettings, ReplicationState
from policies.scaling import ScalePlan, ScalingSettings, ScalingState
from policies.snapshot import ClusterSnapshot


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    burst: BurstSettings = BurstSettings()
    replication: ReplicationSettings = ReplicationSettings()
    migration: MigrationSettings = MigrationSettings()
    scaling: ScalingSettings = ScalingSettings()


@dataclass(frozen=True, slots=True)
class RebalanceState:
    burst: BurstState = BurstState()
    replication: ReplicationState = ReplicationState()
    migration: MigrationState = MigrationState()
    scaling: ScalingState = ScalingState()


@dataclass(frozen=True, slots=True)
class RebalancePlan:
    burst: BurstPlan
    copies: tuple[Replicate, ...] = ()
    moves: tuple[Move, ...] = ()
    scale: ScalePlan | None = None


def decide(snapshot: ClusterSnapshot, state: RebalanceState | None, now_s: float,
           settings: RebalanceSettings = RebalanceSettings()
           ) -> tuple[RebalancePlan, RebalanceState]:
    """One pass of every rebalancing policy over a snapshot."""
    state = state or RebalanceState()
    burst_plan, burst_state = burst.decide(snapshot, state.burst, now_s, settings.burst)
    view = LoadView(snapshot, burst_plan)
    copies, replication_state = replication.decide(view, state.replication, now_s,
                                                   settings.replication)
    moves, migration_state = migration.decide(view, state.migration, now_s, settings.migration)
    scale, scaling_state = scaling.decide(view, state.scaling, now_s, settings.scaling)
    plan = RebalancePlan(burst_plan, copies, moves, scale)  # hot is copied, cold moves
    return plan, RebalanceState(burst_state, replication_state, migration_state, scaling_state)

