"""The rebalancing policies as pure functions: exact plans for given snapshots (no Ray)."""

from __future__ import annotations

import math

import pytest

from policies import burst, migration, rebalance, replication, scaling
from policies.burst import BurstPlan, BurstSettings, BurstState, Rates
from policies.migration import MigrationSettings, MigrationState, Move
from policies.replication import LoadView, Replicate, ReplicationSettings, ReplicationState
from policies.scaling import ScalePlan, ScalingSettings, ScalingState
from policies.snapshot import ClusterSnapshot, NodeLoad, PrefixLoad

MiB = 1 << 20
K = [bytes([i]) * 16 for i in range(10)]  # page keys


def node(node_id: str, num_requests: int = 0, used_mib: int = 0, capacity_mib: int = 100):
    return NodeLoad(node_id, num_requests, used_mib * MiB, capacity_mib * MiB)


def prefix(last: int, num_requests: int = 0, holders=("a",), first: int = 0,
           page_mib: int = 1):
    return PrefixLoad(K[last], tuple(K[first : last + 1]), num_requests, tuple(holders),
                      page_mib * MiB)


def view(nodes, prefixes, hot=(), hot_nodes=(), rates=None, node_rates=None) -> LoadView:
    rates = rates or {}
    snapshot = ClusterSnapshot(tuple(nodes), tuple(prefixes))
    plan = BurstPlan(rates, node_rates or {}, frozenset(hot), frozenset(hot_nodes))
    return LoadView(snapshot, plan)


# ---- burst detection ------------------------------------------------------------------------


def test_ewma_of_rates_from_cumulative_counts():
    before = Rates({"x": 10, "gone": 3}, {"x": 1.0, "gone": 9.0})
    after = burst.ewma(before, {"x": 30, "new": 4}, elapsed_s=2.0, tau_s=2.0)
    alpha = 1 - math.exp(-1)
    assert after.rates_per_s["x"] == pytest.approx(1.0 + alpha * (10.0 - 1.0))
    assert after.rates_per_s["new"] == pytest.approx(alpha * 2.0)
    assert "gone" not in after.rates_per_s and after.counts == {"x": 30, "new": 4}


def test_first_snapshot_is_only_the_baseline():
    snapshot = ClusterSnapshot((node("a", 500),), (prefix(2, 400),))
    plan, state = burst.decide(snapshot, None, 100.0)
    assert plan.prefix_rates_per_s == {K[2]: 0.0} and plan.hot_prefixes == frozenset()
    assert state.updated_s == 100.0 and state.prefixes.counts == {K[2]: 400}


def test_prefix_burst_starts_at_enter_and_ends_below_exit_only():
    settings = BurstSettings(tau_s=1e-9, enter_per_s=10.0, exit_per_s=2.0)  # no smoothing
    state, count, hot_seen = None, 0, []
    for per_s in (0, 12, 5, 3, 1.5, 5, 12):
        count += per_s
        snapshot = ClusterSnapshot((), (prefix(1, count),))
        plan, state = burst.decide(snapshot, state, float(len(hot_seen)), settings)
        hot_seen.append((K[1] in plan.hot_prefixes, plan.started, plan.ended))
    assert hot_seen == [(False, (), ()), (True, (K[1],), ()), (True, (), ()), (True, (), ()),
                        (False, (), (K[1],)), (False, (), ()), (True, (K[1],), ())]


def test_the_entry_threshold_follows_the_traffic_share():
    settings = BurstSettings(tau_s=1e-9, enter_per_s=0.1, exit_per_s=0.05, enter_share=0.02,
                             exit_share=0.01)
    state = BurstState(prefixes=Rates({K[1]: 0, K[2]: 0}, {}), updated_s=0.0)
    loads = ClusterSnapshot((), (prefix(1, 10), prefix(2, 0)))  # 10/s and 0.15/s below
    plan, state = burst.decide(loads, state, 1.0, settings)
    loads = ClusterSnapshot((), (prefix(1, 20), prefix(2, 0.15)))
    plan, state = burst.decide(loads, state, 2.0, settings)
    assert plan.hot_prefixes == {K[1]}  # 0.15/s is under 2 % of 10.15/s
    loads = ClusterSnapshot((), (prefix(1, 21), prefix(2, 0.3)))
    plan, state = burst.decide(loads, state, 3.0, settings)
    assert plan.hot_prefixes == {K[1], K[2]}  # the same 0.15/s is 13 % of 1.15/s


def test_hot_node_by_ratio_to_the_mean_with_hysteresis():
    settings = BurstSettings(tau_s=1e-9, node_enter_ratio=1.5, node_exit_ratio=1.2,
                             node_min_per_s=1.0)
    state = BurstState(nodes=Rates({"a": 0, "b": 0, "c": 0}, {}), updated_s=0.0)
    snapshot = ClusterSnapshot((node("a", 30), node("b", 10), node("c", 10)), ())
    plan, state = burst.decide(snapshot, state, 1.0, settings)  # mean 16.7: a is 1.8x
    assert plan.hot_nodes == {"a"}
    snapshot = ClusterSnapshot((node("a", 52), node("b", 20), node("c", 50)), ())
    plan, state = burst.decide(snapshot, state, 2.0, settings)  # 22, 10, 40: mean 24
    assert plan.hot_nodes == {"c"}  # a fell below 1.2 x 24; c passed 1.5 x 24
    snapshot = ClusterSnapshot((node("a", 82), node("b", 30), node("c", 82)), ())
    plan, state = burst.decide(snapshot, state, 3.0, settings)  # 30, 10, 32: mean 24
    assert plan.hot_nodes == {"c"}  # c stays above 1.2x; a, between the two, does not enter
    assert plan.node_rates_per_s == pytest.approx({"a": 30.0, "b": 10.0, "c": 32.0})


# ---- replication ----------------------------------------------------------------------------


def test_hot_prefix_copied_to_the_least_loaded_nodes_from_the_least_loaded_holder():
    nodes = [node("a"), node("b"), node("c"), node("d")]
    hot = prefix(3, holders=("a", "b"))  # 4 pages of 1 MiB
    v = view(nodes, [hot], hot=[K[3]], rates={K[3]: 7.0},
             node_rates={"a": 9.0, "b": 3.0, "c": 5.0, "d": 1.0})
    settings = ReplicationSettings(per_copy_per_s=2.0)  # 7/s wants 4 copies: two more
    copies, state = replication.decide(v, None, 10.0, settings)
    assert copies == (Replicate(K[3], hot.keys, "b", "d"), Replicate(K[3], hot.keys, "b", "c"))
    assert state.planned == {(K[3], "d"): 10.0, (K[3], "c"): 10.0}
    again, state = replication.decide(v, state, 11.0, settings)  # on their way: not again
    assert again == ()
    retried, _ = replication.decide(v, state, 16.0, settings)  # never arrived: retried
    assert {c.target for c in retried} == {"c", "d"}


def test_replication_respects_the_hot_share_of_memory_and_skips_cold_prefixes():
    nodes = [node("a"), node("b", capacity_mib=10), node("c")]
    big = prefix(9, holders=("a",))  # 10 MiB
    cold = prefix(2, holders=("a",))
    v = view(nodes, [big, cold], hot=[K[9]], rates={K[9]: 100.0, K[2]: 0.1})
    copies, _ = replication.decide(v, None, 0.0, ReplicationSettings(max_hot_fraction=0.5))
    assert copies == (Replicate(K[9], big.keys, "a", "c"),)  # b: 10 MiB > half of 10 MiB


def test_replication_plans_nothing_without_a_holder_or_a_hot_prefix():
    nodes = [node("a"), node("b")]
    v = view(nodes, [prefix(2, holders=())], hot=[K[2]], rates={K[2]: 50.0})
    assert replication.decide(v, None, 0.0)[0] == ()
    v = view(nodes, [prefix(2)], rates={K[2]: 50.0})
    assert replication.decide(v, None, 0.0)[0] == ()


def test_a_copy_that_arrived_is_forgotten():
    state = ReplicationState({(K[2], "b"): 0.0})
    v = view([node("a"), node("b")], [prefix(2, holders=("a", "b"))], hot=[K[2]],
             rates={K[2]: 1.0})
    copies, state = replication.decide(v, state, 1.0)
    assert copies == () and state.planned == {}


# ---- migration ------------------------------------------------------------------------------


def test_cold_prefix_on_a_hot_node_is_dropped_where_a_copy_stays_elsewhere():
    cold = prefix(3, holders=("a", "b"))
    roomy = [node("a", used_mib=50), node("b", used_mib=50)]
    v = view(roomy, [cold], hot_nodes=["a"], rates={K[3]: 0.0})
    assert migration.decide(v, None, 5.0)[0] == ()  # busy, but with room: nothing to gain
    nodes = [node("a", used_mib=75), node("b", used_mib=50)]
    v = view(nodes, [cold], hot_nodes=["a"], rates={K[3]: 0.0})
    moves, state = migration.decide(v, None, 5.0)
    assert moves == (Move(K[3], cold.keys, "a", None),)
    assert state.moved == {K[3]: 5.0}
    assert migration.decide(v, state, 6.0)[0] == ()  # cooling down
    assert migration.decide(v, state, 15.0)[0] == moves


def test_cold_prefix_moves_from_a_full_node_to_the_coolest_with_room():
    nodes = [node("a", used_mib=95), node("b", used_mib=69), node("c", used_mib=10),
             node("d", used_mib=20)]
    cold = prefix(3, holders=("a",), page_mib=1)
    v = view(nodes, [cold], rates={K[3]: 0.1}, node_rates={"b": 0.0, "c": 9.0, "d": 1.0})
    moves, _ = migration.decide(v, None, 0.0, MigrationSettings(low_fraction=0.7))
    assert moves == (Move(K[3], cold.keys, "a", "d"),)  # b would pass 70 %; d is cooler than c


def test_pages_shared_with_a_warm_prefix_never_move():
    nodes = [node("a", used_mib=95), node("b")]
    system = prefix(1, holders=("a",))  # pages 0-1: still in use
    chat = prefix(4, holders=("a",))  # pages 0-4: cold
    v = view(nodes, [system, chat], rates={K[1]: 1.0, K[4]: 0.0})
    moves, _ = migration.decide(v, None, 0.0)
    assert moves == (Move(K[4], (K[2], K[3], K[4]), "a", "b"),)


def test_no_pressure_no_moves():
    v = view([node("a", used_mib=10), node("b")], [prefix(3, holders=("a", "b"))])
    assert migration.decide(v, MigrationState(), 0.0)[0] == ()


# ---- scaling --------------------------------------------------------------------------------


def scaling_view(num_nodes: int, rate_per_s: float, used_mib: int = 10) -> LoadView:
    nodes = [node(f"n{i}", used_mib=used_mib) for i in range(num_nodes)]
    return view(nodes, [], node_rates={f"n{i}": rate_per_s for i in range(num_nodes)})


def test_scale_out_after_sustained_pressure_then_cooldown():
    settings = ScalingSettings(min_nodes=1, max_nodes=4, out_per_node_per_s=10.0,
                               sustain_s=5.0, cooldown_s=30.0)
    plan, state = scaling.decide(scaling_view(2, 20.0), None, 0.0, settings)
    assert plan is None and state == ScalingState(2, 0.0, None, None)
    plan, state = scaling.decide(scaling_view(2, 20.0), state, 4.0, settings)
    assert plan is None
    plan, state = scaling.decide(scaling_view(2, 20.0), state, 5.0, settings)
    assert plan == ScalePlan(3, ({"kv_node": 1.0},) * 3, "pressure")
    assert state == ScalingState(3, None, None, 5.0)
    plan, state = scaling.decide(scaling_view(3, 20.0), state, 20.0, settings)
    assert plan is None  # cooling down
    plan, state = scaling.decide(scaling_view(3, 20.0), state, 40.0, settings)
    assert plan == ScalePlan(4, ({"kv_node": 1.0},) * 4, "pressure")


def test_a_node_asked_for_and_not_arrived_is_not_asked_for_again():
    settings = ScalingSettings(max_nodes=8, out_per_node_per_s=1.0, sustain_s=0.0,
                               cooldown_s=0.0)
    plan, state = scaling.decide(scaling_view(2, 5.0), ScalingState(2), 0.0, settings)
    assert plan.num_nodes == 3
    plan, state = scaling.decide(scaling_view(2, 5.0), state, 1.0, settings)
    assert plan is None and state.num_nodes == 3


def test_scale_in_when_idle_and_memory_low_down_to_min_nodes():
    settings = ScalingSettings(min_nodes=2, max_nodes=4, in_per_node_per_s=1.0,
                               in_memory_fraction=0.5, sustain_s=0.0, cooldown_s=0.0)
    plan, _ = scaling.decide(scaling_view(3, 0.1), ScalingState(3), 0.0, settings)
    assert plan == ScalePlan(2, ({"kv_node": 1.0},) * 2, "idle")
    plan, _ = scaling.decide(scaling_view(2, 0.1), ScalingState(2), 0.0, settings)
    assert plan is None  # at min_nodes
    plan, _ = scaling.decide(scaling_view(3, 0.1, used_mib=60), ScalingState(3), 0.0, settings)
    assert plan is None  # memory still in use


def test_memory_pressure_scales_out_and_max_nodes_zero_never_asks():
    settings = ScalingSettings(max_nodes=3, sustain_s=0.0, out_memory_fraction=0.9)
    plan, _ = scaling.decide(scaling_view(2, 0.0, used_mib=95), ScalingState(2), 0.0, settings)
    assert plan.num_nodes == 3 and plan.reason == "pressure"
    plan, _ = scaling.decide(scaling_view(2, 1e6, used_mib=99), None, 0.0, ScalingSettings())
    assert plan is None


# ---- the whole ------------------------------------------------------------------------------


def test_rebalance_replicates_a_prefix_that_bursts():
    settings = rebalance.RebalanceSettings(burst=BurstSettings(tau_s=1e-9, enter_per_s=5.0))
    nodes = (node("a", 0), node("b", 0), node("c", 0))
    plan, state = rebalance.decide(ClusterSnapshot(nodes, (prefix(2, 0),)), None, 0.0,
                                   settings)
    assert plan.copies == () and plan.moves == () and plan.scale is None
    burst_snapshot = ClusterSnapshot(nodes, (prefix(2, 40),))  # 40 requests in 1 s
    plan, state = rebalance.decide(burst_snapshot, state, 1.0, settings)
    assert plan.burst.started == (K[2],)
    assert {(c.source, c.target) for c in plan.copies} == {("a", "b"), ("a", "c")}
    plan, _ = rebalance.decide(burst_snapshot, state, 2.0, settings)
    assert plan.copies == ()  # planned already, not in the directory yet


def test_node_load_reads_the_elastic_pool_or_the_per_pool_budgets():
    from actors.control_loop import node_load
    from cluster.core.config import CacheConfig

    config = CacheConfig(device_bytes=2 * MiB, host_bytes=8 * MiB)
    # Gets through the actor, gets straight from shared memory, the page server's requests.
    per_pool = {"gets": 5, "optimistic_reads": 2, "dataplane": {"requests": 3}, "num_pools": 2,
                "bytes": {"device": 1 * MiB, "host": 5 * MiB, "disk": 9 * MiB}}
    assert node_load("a", per_pool, config) == NodeLoad("a", 10, 6 * MiB, 20 * MiB)
    elastic = {**per_pool, "memory": {"tiers": {
        "device": {"capacity_bytes": 2 * MiB, "held_bytes": 1 * MiB},
        "host": {"capacity_bytes": 8 * MiB, "held_bytes": 4 * MiB},
        "disk": {"capacity_bytes": 64 * MiB, "held_bytes": 9 * MiB}}}}
    assert node_load("a", elastic, config) == NodeLoad("a", 10, 5 * MiB, 10 * MiB)
