"""The cluster simulator against the service it models: the raykv router is fed what the live
router feeds `decide` (queue waits estimated from counts, power of two without hits), the
Mooncake-like router its paper's queue estimate, a page on another node's disk costs that
disk's read and is read up on its holder, the control loop runs on its own period, and a hit's
own pages are pinned through every demotion its promotion causes. No Ray is started."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors import handles
from cluster.core import sim_cluster
from cluster.core.geometry import DEVICE, DISK
from cluster.core.sim_cluster import REMOTE, Route, SimCluster, SimDirectory, SimRequest
from cluster.core.sim_control import SimControlLoop
from cluster.core.sim_routers import make_router
from cluster.tools import sim, sim_fig10
from tests.unit.test_sim_cluster import TOY, k
from tests.unit.test_sim_cluster import TOY_NODE as TOY_CLUSTER_NODE

ROOT = Path(__file__).resolve().parents[2]


# test_sim_cluster.py's toy (1,000 prefill tokens/s, 512-byte pages, the NIC at 512 B/s
# after 0.5 s), here with a disk tier of 4 pages at 256 B/s after 0.25 s.
TOY_NODE = dataclasses.replace(TOY_CLUSTER_NODE, disk_kv_bytes=4 * 512, disk_bytes_per_s=256.0,
                               disk_latency_s=0.25)


def toy_cluster(num_nodes: int = 2) -> SimCluster:
    directory = SimDirectory(1, handles.split_by_shard, handles.merge_shard_prefixes)
    return SimCluster(TOY_NODE, TOY, num_nodes, "lru", directory)


def to(node: int):
    return lambda cluster, request, located: node


def test_sim_raykv_router_counts_queued_requests_not_the_queues_exact_seconds():
    cluster = toy_cluster()
    for i in range(3):  # node 0 computes three 10-token requests: 0.01 s per request
        cluster.serve(SimRequest(float(i), [], 10, 1), to(0))
    cluster.nodes[0].put([k("a"), k("b"), k("c"), k("d")])
    cluster.sync_node(0)
    cluster.serve(SimRequest(4.0, [], 100_000, 196), to(0))  # node 0 busy for 100 s
    late = SimRequest(5.0, [k("a"), k("b"), k("c"), k("d")], 2049, 5)
    # Live, node 0's wait is 1 request x 0.01 s: it holds the prefix, so it wins (0.011 s
    # against 2.049 s on node 1); its exact remaining wait (99 s) would send it to node 1.
    assert make_router("raykv")(cluster, late, cluster.locate(late.keys)) == Route(0, 4)


def test_sim_raykv_router_falls_back_to_power_of_two_without_hits():
    cluster = toy_cluster()
    cluster.serve(SimRequest(0.0, [], 10_000, 20), to(0))  # node 0: 10 s per request
    for i in range(2):
        cluster.serve(SimRequest(20.0 + i, [], 10, 1), to(1))  # node 1: 0.01 s per request
    cluster.serve(SimRequest(30.0, [], 10_000, 20), to(0))  # one in flight on node 0 (9 s)
    cluster.serve(SimRequest(30.995, [], 10, 1), to(1))  # two in flight on node 1 (0.015 s)
    cluster.serve(SimRequest(30.995, [], 10, 1), to(1))
    cold = SimRequest(31.0, [k("x")], 1024, 2)  # held nowhere
    choose = make_router("raykv")
    # Costs would send it to node 1, estimated (2 x 0.01 s against 1 x 10 s) or exact; the
    # live router has no hit to weigh and takes power of two choices: of two nodes, the
    # shorter queue, node 0.
    assert choose(cluster, cold, cluster.locate(cold.keys)) in (0, Route(0, 0))
    assert choose.fallbacks == 1


def test_mooncake_estimates_its_queue_from_the_queued_requests_predicted_times():
    cluster = toy_cluster()
    cluster.nodes[0].put([k("a"), k("b")])
    cluster.sync_node(0)
    cluster.serve(SimRequest(0.0, [], 10_000, 20), to(0))  # 10 s on node 0, from 0 s
    late = SimRequest(9.5, [k("a"), k("b"), k("c")], 1536, 3)
    # The exact remaining wait (0.5 s) would keep it on node 0 (0.5 + 0.512 s, against a
    # 2.5 s fetch on node 1); the conductor counts the running request's whole 10 s.
    assert make_router("mooncake")(cluster, late, cluster.locate(late.keys)) == 1


def test_a_page_on_another_nodes_disk_costs_that_disks_read_and_is_read_up_there():
    cluster = toy_cluster()
    cluster.nodes[0]._place([k("a")], DISK)
    cluster.sync_node(0)
    request = SimRequest(1.0, [k("a")], 513, 2)
    located = cluster.locate(request.keys)
    assert cluster.plan(1, request.keys, located) == [sim_cluster.REMOTE_DISK]
    # disk latency + NIC latency + 512 B at the slower of 256 B/s (disk) and 512 B/s (NIC),
    # then 1 token of prefill
    assert cluster.serve(request, to(1)) == pytest.approx(0.25 + 0.5 + 2.0 + 0.001)
    assert cluster.nodes[0].tier_of[k("a")] == DEVICE  # acquired on its holder: read up
    assert cluster.tally.hits_by_source[sim_cluster.REMOTE_DISK] == 1
    # from the holder's memory it is the NIC's cost alone
    again = SimRequest(2.0, [k("a")], 513, 2)
    cluster.complete(1.5)
    cluster.nodes[1].discard([k("a")])
    cluster.sync_node(1)
    assert cluster.plan(1, again.keys, cluster.locate(again.keys)) == [REMOTE]


def test_the_control_loop_runs_every_period_between_arrivals():
    times = []

    def policy(snapshot, state, now_s):
        times.append(now_s)
        return SimpleNamespace(copies=(), moves=()), state

    cluster = toy_cluster()
    cluster.control = SimControlLoop(period_s=0.5, policy=policy)
    cluster.serve(SimRequest(0.0, [k("a")], 600, 2), to(0))
    cluster.serve(SimRequest(3.2, [k("a")], 600, 2), to(1))
    assert times == pytest.approx([0.5 * i for i in range(7)])  # 0, 0.5, ..., 3.0
    # the pass at 1.0 s saw the first request's page, landed at 0.6 s
    assert cluster.control.counters["passes"] == 7


def test_a_hits_own_host_pages_are_pinned_through_its_promotions_demotions():
    node = sim_cluster.SimNode([1, 1, 0], "lru")
    node.put([k("a")])
    node.put([k("b")])  # a goes down to host
    assert node.tier_of == {k("a"): 1, k("b"): 0}
    # Promoting a demotes b into host, whose only page is a itself: pinned, so b (with no
    # disk below) is dropped, and a goes up.
    assert node.acquire([k("a")]) == [1]
    assert node.tier_of == {k("a"): 0} and node.counts == [1, 0, 0]


def test_the_hit_bound_goal_is_measured_where_capacity_forces_eviction():
    assert "sim_hit_vs_global_bound" in sim.PART_GOALS["fig10"]
    assert "sim_hit_vs_global_bound" not in sim.PART_GOALS["routing"]
    runs = {"global": {"raykv": {"hit_ratio": 0.3}}, "pooled": {"hit_ratio": 0.4}}
    fig10 = {"policies": {sim_fig10.default_policy(): runs}, "global_router": "raykv"}
    assert sim_fig10.fig10_ratios(fig10) == {"sim_hit_vs_global_bound": pytest.approx(0.75)}
