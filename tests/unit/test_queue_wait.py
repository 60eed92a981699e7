"""The cost router's queue wait (policies/queue_wait.py): a virtual queue of the predicted
seconds of work the router sent each replica, worked off with the clock, drained when none of
its requests is left there, plus the requests other routers sent at a count x mean; shared
by the live router and the simulator's. No Ray is started."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.core.sim_cluster import SimRequest
from cluster.core.sim_routers import make_router
from policies.cost_routing import HOST, Candidate, Prompt, decide, prior_rates
from policies.queue_wait import VirtualQueue, own_or_mean, queue_waits
from tests.unit.test_sim_cluster import k
from tests.unit.test_sim_fidelity import toy_cluster

ROOT = Path(__file__).resolve().parents[2]


def test_routing_adds_its_predicted_work_behind_what_is_queued():
    queue = VirtualQueue()
    queue.routed("a", "r1", 2.0, now_s=10.0)
    queue.routed("a", "r2", 3.0, now_s=11.0)  # behind r1's: busy until 15 s
    queue.routed("b", "r3", 1.0, now_s=11.0)
    assert queue.wait_s("a", 11.0) == pytest.approx(4.0)
    assert queue.wait_s("b", 11.0) == pytest.approx(1.0)
    assert queue.wait_s("c", 11.0) == 0.0  # nothing sent there
    assert queue.wait_s("a", 14.0) == pytest.approx(1.0)  # worked off with the clock
    assert queue.wait_s("a", 20.0) == 0.0  # never below 0
    queue.routed("a", "r4", 1.0, now_s=20.0)  # an idle replica starts it now
    assert queue.wait_s("a", 20.0) == pytest.approx(1.0)


def test_completion_drains_a_replica_once_none_of_its_requests_is_left():
    queue = VirtualQueue()
    queue.routed("a", "r1", 5.0, now_s=0.0)
    queue.routed("a", "r2", 5.0, now_s=0.0)
    assert queue.completed("r1", 1.0) == "a"  # one left: its predicted work stands
    assert queue.wait_s("a", 1.0) == pytest.approx(9.0)
    assert queue.completed("r2", 2.0) == "a"  # done early: the queue is empty now
    assert queue.wait_s("a", 2.0) == 0.0 and queue.in_flight == {}
    assert queue.completed("r2", 3.0) is None  # heard once; an unknown id is nobody's
    assert queue.completed("elsewhere", 3.0) is None


def test_a_request_routed_again_or_moved_counts_once_where_it_went():
    queue = VirtualQueue()
    queue.routed("a", "r0", 1.0, now_s=0.0)
    queue.routed("a", "r1", 4.0, now_s=0.0)
    queue.routed("a", "r1", 4.0, now_s=0.0)  # Serve asked again for the same request
    assert queue.wait_s("a", 0.0) == pytest.approx(5.0) and queue.in_flight == {"a": 2}
    queue.moved("r1", "b", 0.0)  # Serve took a later rank
    assert queue.wait_s("a", 0.0) == pytest.approx(1.0)
    assert queue.wait_s("b", 0.0) == pytest.approx(4.0)
    assert queue.in_flight == {"a": 1, "b": 1}


def test_other_routers_requests_count_at_the_replicas_seconds_per_request():
    queue = VirtualQueue()
    queue.routed("a", "r1", 2.0, now_s=0.0)
    # a reports 4 in flight: 1 is this router's (2 s), 3 are others' at 0.5 s each; b's
    # count is below this router's own (a stale figure): no others; c reports none.
    waits = queue.waits(["a", "b", "c"], 0.0, {"a": 4, "b": 0, "c": None},
                        {"a": 0.5, "b": 0.5, "c": 0.5})
    assert waits == pytest.approx({"a": 2.0 + 3 * 0.5, "b": 0.0, "c": 0.0})
    # queue_waits: a replica without a measured figure counts another router's request as
    # one prefill of this prompt at its rate (1,000 tokens at 2,000 tokens/s).
    prompt = Prompt(1000, 16, 1024)
    waits = queue_waits(prompt, VirtualQueue(), {"a": 2, "b": 1}, {"a": 0.25}, prior_rates(),
                        0.0)
    assert waits == pytest.approx({"a": 0.5, "b": 0.5})


def test_a_replica_with_a_request_in_flight_waits_at_least_one_step_past_its_prediction():
    """The prediction ran out (2 s routed 3 s ago) and the request has not ended: the
    replica waits its step overhead, not 0, so an idle replica wins a tie against it; once
    the request ends, it waits nothing."""
    queue = VirtualQueue()
    queue.routed("a", "r1", 2.0, now_s=0.0)
    steps = {"a": 0.05, "b": 0.05}
    assert queue.waits(["a", "b"], 1.0, step_s=steps) == pytest.approx({"a": 1.0, "b": 0.0})
    assert queue.waits(["a", "b"], 3.0, step_s=steps) == pytest.approx({"a": 0.05, "b": 0.0})
    assert queue.waits(["a", "b"], 3.0) == {"a": 0.0, "b": 0.0}  # no step measured: as before
    queue.completed("r1", 3.5)
    assert queue.waits(["a", "b"], 3.5, step_s=steps) == {"a": 0.0, "b": 0.0}
    # decide, fed these waits, sends an equal-cost request to the idle replica first.
    prompt = Prompt(1000, 16, 1024)
    queue.routed("a", "r2", 0.1, now_s=4.0)
    waits = queue_waits(prompt, queue, {"a": None, "b": None}, {}, prior_rates(), 5.0, steps)
    decision = decide(prompt, [Candidate(r, (HOST,), waits[r]) for r in ("a", "b")],
                      prior_rates())
    assert decision.replica_id == "b"


def test_a_replica_without_its_own_step_overhead_borrows_the_others_mean():
    assert own_or_mean({"a": 0.02, "b": 0.04, "c": None}) == pytest.approx(
        {"a": 0.02, "b": 0.04, "c": 0.03})
    assert own_or_mean({"a": None}) == {"a": 0.0}


def test_stale_entries_expire_and_the_entries_are_bounded():
    queue = VirtualQueue(ttl_s=60.0, max_entries=2)
    queue.routed("a", "lost", 10.0, now_s=0.0)  # its completion never comes
    queue.routed("b", "r1", 1.0, now_s=30.0)
    assert queue.waits(["a"], 59.0) == {"a": 0.0}  # worked off by the clock already
    assert "lost" in queue.entries
    queue.expire(61.0)
    assert "lost" not in queue.entries and queue.in_flight == {"b": 1}
    assert queue.expired == 1
    queue.routed("b", "r2", 1.0, now_s=62.0)
    queue.routed("b", "r3", 1.0, now_s=62.0)  # a third: the oldest goes
    assert list(queue.entries) == ["r2", "r3"] and queue.expired == 2


def test_the_sim_router_prices_its_own_routed_work_and_hears_each_request_end():
    cluster = toy_cluster()
    cluster.nodes[0].put([k("a"), k("b")])
    cluster.sync_node(0)
    choose = make_router("raykv")
    long = SimRequest(0.0, [k("a"), k("b")], 10_000, 20)  # node 0 holds its prefix
    cluster.serve(long, choose)
    entry = choose.queue.entries[0]  # serve's first request: id 0
    assert entry[0] == "0"
    # What decide priced it at: 1,024 tokens fetched from node 0's device, the rest
    # prefilled at the profile's rate (1,000 tokens/s), ~8.98 s.
    assert choose.queue.wait_s("0", 0.0) == pytest.approx(entry[2]) and entry[2] > 8.9
    # A count x mean would say 1 request x node 0's seconds per request, 0 before any
    # finished (then a prefill of the new prompt, 1.5 s): the virtual queue knows 8 s are
    # left at 1 s, so a request whose prefix node 0 holds goes to node 1.
    late = SimRequest(1.0, [k("a"), k("b"), k("c")], 1536, 3)
    assert cluster.serve(late, choose) < 3.0
    assert choose.queue.entries[1][0] == "1"
    cluster.queue_lengths(100.0)  # both ended: the router heard it, its queues drained
    assert choose.queue.entries == {} and choose.queue.wait_s("0", 100.0) == 0.0


def test_live_and_simulated_routers_share_the_virtual_queue():
    from cluster.core import sim_routers
    from policies import queue_wait

    assert sim_routers.VirtualQueue is queue_wait.VirtualQueue
    assert sim_routers.queue_waits is queue_wait.queue_waits
    assert sim_routers.own_or_mean is queue_wait.own_or_mean
    service = ast.parse((ROOT / "cluster/serving/router.py").read_text())
    imported = {alias.name for node in ast.walk(service) if isinstance(node, ast.ImportFrom)
                and node.module == "policies.queue_wait" for alias in node.names}
    assert {"VirtualQueue", "queue_waits", "own_or_mean"} <= imported
    module = ast.parse((ROOT / "policies/queue_wait.py").read_text())
    imports = {alias.name.split(".")[0] for node in ast.walk(module)
               if isinstance(node, ast.Import | ast.ImportFrom)
               for alias in getattr(node, "names", [])} | {
        node.module.split(".")[0] for node in ast.walk(module)
        if isinstance(node, ast.ImportFrom) and node.module}
    assert "ray" not in imports  # pure: no Ray
