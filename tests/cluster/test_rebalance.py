"""Rebalancing on a 3-node cluster: a replayed spike makes its prefix hot, and the control loop
copies it to the other nodes before any request there asks for it; scaling asks the
autoscaler for a kv node under pressure (read back from the GCS), sees the node arrive
(Cluster.add_node), and asks for fewer when idle."""

from __future__ import annotations

import functools
import threading

import pytest
import ray

from actors.autoscaler import request_bundles, requested_bundles
from actors.handles import ControlLoopHandle
from actors.spawn import spawn_control_loop
from cluster import CacheConfig, start
from cluster.api import running_config
from cluster.core.config import MiB
from cluster.core.spec import ModelSpec
from cluster.tools.replay import ReplaySettings, replay_client
from cluster.tools.traces import TraceShape, make_trace, prompt_tokens
from policies import rebalance
from policies.scaling import ScalingSettings
from tests.cluster.conftest import node_args, node_id_of, wait_until
from tests.cluster.replica import replica_on

SHAPE = TraceShape(duration_s=12.0, base_rate_per_s=3.0, spike_factor=10.0, first_spike_s=3.0,
                   spike_every_s=30.0, spike_s=8.0, ramp_s=1.0, num_prefixes=20,
                   num_spike_prefixes=1, spike_ranks=6, prefix_pages=(2, 4), page_tokens=16,
                   models=("tiny-llama",), num_nodes=3, node_capacity_per_s=1000.0, seed=3)


@pytest.fixture(scope="module")
def nodes(ray_cluster, disk_root):
    start(CacheConfig(page_tokens=16, device_bytes=0, host_bytes=8 * MiB, disk_bytes=8 * MiB,
                      disk_dir=disk_root, rebalance_period_s=0.2))
    return [node_id_of(name) for name in ("node_a", "node_b", "node_c")]


def test_a_spiking_prefix_is_copied_to_the_nodes_that_never_asked_for_it(nodes):
    trace = make_trace(SHAPE)  # every request at its prefix's home node: no overflow
    hot = max({r.prefix_id for r in trace if r.spike},
              key=lambda p: sum(r.prefix_id == p for r in trace))
    home = hot % 3
    assert all(r.node == home for r in trace if r.prefix_id == hot)
    outcomes, _ = replay_client(trace, nodes, ReplaySettings(max_ongoing=4))
    assert len(outcomes) == len(trace) and max(o.fetch_s for o in outcomes) < 30
    sample = next(r for r in trace if r.prefix_id == hot)
    others = [n for i, n in enumerate(nodes) if i != home]
    reader = replica_on(others[0], ModelSpec.preset("tiny-llama"))
    located = ray.get(reader.located.remote(prompt_tokens(sample)[: sample.prefix_tokens]))
    assert len(located) == sample.prefix_tokens // 16, "the hot prefix is cached"
    holders = set.intersection(*({node for node, _ in places} for places in located))
    assert holders == set(nodes), f"copies of the hot prefix: {holders}"
    loop = ControlLoopHandle.lookup(running_config())
    stats = ray.get(loop.stats())
    copies = [e for e in stats["events"] if e["kind"] == "copy"]
    assert {e["target"] for e in copies} >= set(others) and stats["failed_actions"] == 0
    assert stats["loop_errors"] == {"rebalance": 0}
    ray.kill(reader)


class Load:
    """Gets of one cached prefix from a replica, on a thread, until stopped."""

    def __init__(self, node_id: str):
        import torch

        spec = ModelSpec.preset("tiny-llama")
        self.replica = replica_on(node_id, spec)
        self.tokens = list(range(64))
        ray.get(self.replica.put.remote(self.tokens, torch.zeros(spec.page_shape(64))))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            ray.get([self.replica.get.remote(self.tokens) for _ in range(8)])

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def test_scale_out_under_pressure_then_in_when_idle(nodes, ray_cluster):
    cluster, _ = ray_cluster
    config = running_config()
    scaling = ScalingSettings(min_nodes=1, max_nodes=4, out_per_node_per_s=2.0,
                              in_per_node_per_s=0.5, out_memory_fraction=1.0,
                              in_memory_fraction=1.0, sustain_s=1.0, cooldown_s=3.0)
    policy = functools.partial(rebalance.decide, settings=rebalance.RebalanceSettings(
        scaling=scaling))
    request_bundles([])
    load = Load(nodes[0])  # under way before the loop's first look (else it sees idle first)
    loop = spawn_control_loop(config, policy, name="raykv-control-loop-scaling")
    ray.get(loop.start())
    fourth = None
    try:
        wait_until(lambda: requested_bundles() == [{"kv_node": 1.0}] * 4, 60,
                   "a request for a 4th kv node")
        fourth = cluster.add_node(**node_args("node_d"))  # the autoscaler's node, simulated
        wait_until(lambda: ray.get(loop.step())["nodes"] == 4, 90, "the new node's actor")
        load.stop()
        wait_until(lambda: requested_bundles() == [{"kv_node": 1.0}] * 3, 60,
                   "a smaller request once idle")
        events = [e for e in ray.get(loop.stats())["events"] if e["kind"] == "scale"]
        assert [(e["nodes"], e["reason"]) for e in events] == [(4, "pressure"), (3, "idle")]
    finally:
        load.stop()
        loop.kill()
        ray.kill(load.replica)
        request_bundles([])
        if fourth is not None:
            cluster.remove_node(fourth)
