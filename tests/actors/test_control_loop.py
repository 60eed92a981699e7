"""The control loop on a local Ray: it runs with the service, survives a policy that raises,
and its scale plans reach the autoscaler's standing request (read back from the GCS)."""

from __future__ import annotations

import time

import ray

from actors.autoscaler import request_bundles, requested_bundles
from actors.handles import ControlLoopHandle
from actors.spawn import spawn_control_loop
from policies.burst import BurstPlan
from policies.rebalance import RebalancePlan
from policies.scaling import ScalePlan

EMPTY_BURST = BurstPlan({}, {}, frozenset(), frozenset())


class FlakyPolicy:
    """Raises on its first `num_failures` calls, then asks for `num_nodes` kv nodes."""

    def __init__(self, num_failures: int, num_nodes: int):
        self.num_failures, self.num_nodes, self.calls = num_failures, num_nodes, 0

    def __call__(self, snapshot, state, now_s):
        self.calls += 1
        if self.calls <= self.num_failures:
            raise RuntimeError(f"policy failure {self.calls}")
        bundles = tuple({"kv_node": 1.0} for _ in range(self.num_nodes))
        scale = ScalePlan(self.num_nodes, bundles, "test") if self.calls == 1 + \
            self.num_failures else None
        return RebalancePlan(EMPTY_BURST, scale=scale), {"nodes": len(snapshot.nodes)}


def wait_for(predicate, timeout_s: float, what: str):
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stats_once(loop: ControlLoopHandle, ready, what: str) -> dict:
    """The loop's stats once `ready(stats)` holds."""

    def poll():
        stats = ray.get(loop.stats())
        return stats if ready(stats) else None

    return wait_for(poll, 30, what)


def test_the_service_runs_its_control_loop(service):
    config = service(rebalance_period_s=0.1)
    loop = ControlLoopHandle.lookup(config)
    assert loop is not None
    stats = stats_once(loop, lambda s: s["passes"] >= 3, "three passes")
    assert stats["running"] == ["rebalance"] and stats["loop_errors"] == {"rebalance": 0}
    assert stats["last"]["nodes"] == 1


def test_no_control_loop_without_rebalance(service):
    config = service(rebalance=False)
    assert ControlLoopHandle.lookup(config) is None


def test_the_loop_survives_a_policy_that_raises_and_its_scale_plan_is_requested(service):
    config = service(rebalance=False, rebalance_period_s=0.05)
    request_bundles([])
    loop = spawn_control_loop(config, FlakyPolicy(num_failures=4, num_nodes=3),
                                    name="raykv-control-loop-test")
    try:
        ray.get(loop.start())
        stats = stats_once(loop, lambda s: s["passes"] >= 2, "passes after the failures")
        assert stats["loop_errors"] == {"rebalance": 4} and stats["running"] == ["rebalance"]
        assert stats["scale_requests"] == 1
        assert [e["nodes"] for e in stats["events"] if e["kind"] == "scale"] == [3]
        assert requested_bundles() == [{"kv_node": 1.0}] * 3
        assert ray.get(loop.step())["nodes"] == 1  # a pass on demand still works
    finally:
        loop.kill()
        request_bundles([])
    assert requested_bundles() == []
