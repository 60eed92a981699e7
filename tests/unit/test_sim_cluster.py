"""The cluster simulator: queue and TTFT arithmetic by hand on two nodes, each router's choice on
a tiny case, the trace's rate scaling, and that it runs the service's own policies and
directory functions. No Ray is started."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from actors import handles
from cluster.core import pool, sim_cluster, sim_routers
from cluster.core.directory_index import DirectoryIndex
from cluster.core.keys import shard_of
from cluster.core.sim_cluster import REMOTE, Route, SimCluster, SimDirectory, SimRequest
from cluster.core.sim_events import EngineQueue, num_copies, scale_trace
from cluster.core.sim_profiles import PROFILES, ModelCost, llama3_70b
from cluster.core.sim_routers import make_router
from cluster.core.trace_format import BlockRequest
from cluster.tools import sim_parts
from policies import cost_routing, eviction

ROOT = Path(__file__).resolve().parents[2]


def k(name: str) -> bytes:
    return name.encode().ljust(16, b".")


# A toy model and node: 1,000 prefill tokens/s, no attention term, 1 byte of KV a token (a
# 512-byte page), remote pages at 512 B/s after 0.5 s of latency, device reads free.
TOY = ModelCost("toy", num_params=1.0, num_layers=0, d_attn=0, weight_bytes=0,
                kv_bytes_per_token=1)
TOY_NODE = dataclasses.replace(
    PROFILES["h100-400g"], num_gpus=1, dense_flops=2 * 1000 / 0.4, device_kv_bytes=4 * 512,
    host_kv_bytes=0, disk_kv_bytes=0, hbm_bytes_per_s=1e30, nic_bytes_per_s=512.0,
    nic_latency_s=0.5)


def toy_cluster(shared: bool, num_nodes: int = 2, eviction_name: str = "lru") -> SimCluster:
    directory = (SimDirectory(1, handles.split_by_shard, handles.merge_shard_prefixes)
                 if shared else None)
    return SimCluster(TOY_NODE, TOY, num_nodes, eviction_name, directory)


def to(node: int):
    return lambda cluster, request, located: node


def test_ttft_is_queue_wait_plus_fetch_plus_prefill_on_two_nodes():
    cluster = toy_cluster(shared=True)
    ab = SimRequest(0.0, [k("a"), k("b")], 1024, 2)
    abc = SimRequest(0.5, [k("a"), k("b"), k("c")], 1536, 3)
    # 1,024 tokens at 1,000 tokens/s, an idle node
    assert cluster.serve(ab, to(0)) == pytest.approx(1.024)
    # the first request's pages land at 1.024 s: none yet; it waits 0.524 s, prefills 1,536
    assert cluster.serve(abc, to(0)) == pytest.approx(0.524 + 1.536)
    # at 2 s node 0 holds a and b (c lands at 1.024 + 1.536 = 2.56 s); node 1 fetches both
    # over the NIC (0.5 s + 2 x 512 B at 512 B/s) and prefills the last 512 tokens
    late = SimRequest(2.0, [k("a"), k("b"), k("c")], 1536, 3)
    cluster.complete(late.arrival_s)
    assert cluster.plan(1, late.keys, cluster.locate(late.keys)) == [REMOTE, REMOTE]
    assert cluster.serve(late, to(1)) == pytest.approx(0.5 + 2.0 + 0.512)
    assert cluster.tally.remote_bytes == 2 * 512
    # on node 0 itself the two pages are in the device tier: free to read
    again = SimRequest(10.0, [k("a"), k("b"), k("c")], 1536, 3)
    assert cluster.serve(again, to(0)) == pytest.approx(0.001)  # 1 token left to prefill
    assert cluster.tally.hit_tokens == (2 + 3) * 512


def test_local_caches_do_not_see_other_nodes():
    cluster = toy_cluster(shared=False)
    cluster.serve(SimRequest(0.0, [k("a"), k("b")], 1024, 2), to(0))
    assert cluster.serve(SimRequest(3.0, [k("a"), k("b")], 1024, 2), to(1)) == \
        pytest.approx(1.024)
    assert cluster.serve(SimRequest(6.0, [k("a"), k("b")], 1025, 3), to(0)) == \
        pytest.approx(0.001)


def test_engine_queue_is_fifo_and_counts_what_is_pending():
    queue = EngineQueue()
    assert queue.admit(0.0, 2.0, 4) == (0.0, 2.0)
    assert queue.admit(1.0, 1.0, 3) == (2.0, 3.0)
    assert queue.queue_len(1.5) == 2 and queue.active_blocks(1.5) == 7
    assert queue.wait_s(1.5) == pytest.approx(1.5)
    assert queue.queue_len(2.0) == 1 and queue.active_blocks(2.5) == 3


def test_prefill_has_kaplans_attention_term():
    model = llama3_70b()
    linear = 2 * model.num_params * 1000
    assert model.prefill_flops(0, 1000) == pytest.approx(linear + 80 * 8192 * 1000**2)
    assert model.prefill_flops(1000, 1000) == 0
    profile = PROFILES["h100-400g"]
    assert 15_000 < profile.prefill_tokens_per_s(model) < 30_000
    assert profile.prefill_s(model, 0, 8000) > 8000 / profile.prefill_tokens_per_s(model)


def test_raykv_s_router_prices_prefill_as_the_profile_charges_it():
    """The rates the simulated router is given are the two terms the engines fit online
    (cluster/serving/prefill_fit.py), read off the profile: its prefill estimate of any cut is
    the profile's own prefill time."""
    cluster = SimCluster(PROFILES["h100-400g"], llama3_70b(), 2, "lru", None)
    rates = sim_routers.oracle_rates(cluster)
    prompt = cost_routing.Prompt(8000, 512, cluster.page_bytes)
    for cached_pages in (0, 3, 15):
        assert rates.prefill_s(prompt, cached_pages, "any") == pytest.approx(
            cluster.profile.prefill_s(cluster.model, cached_pages * 512, 8000))


def test_a_full_device_tier_demotes_and_a_hit_promotes():
    node = sim_cluster.SimNode([2, 2, 0], "lru")
    node.put([k("a"), k("b")])
    node.put([k("c")])  # a, the oldest, goes down to host
    assert node.tier_of == {k("a"): 1, k("b"): 0, k("c"): 0}
    assert node.acquire([k("a")]) == [1]  # read from host, then promoted
    assert node.tier_of[k("a")] == 0 and node.tier_of[k("b")] == 1
    node.put([k("d"), k("e"), k("f")])  # host is full too: its victims are dropped
    assert len(node.tier_of) == 4 and node.counts == [2, 2, 0]


def busy(cluster: SimCluster, node: int, num_requests: int, num_blocks: int = 1) -> None:
    for _ in range(num_requests):
        cluster.queues[node].admit(0.0, 100.0, num_blocks)
        cluster._finishes.append((100.0, node, 100.0, -1))  # id: no router routed it
        cluster._queue_lens[node] += 1


def request(*names: str, input_tokens: int | None = None) -> SimRequest:
    keys = [k(n) for n in names]
    return SimRequest(1.0, keys, input_tokens or 512 * len(keys), len(keys))


def test_round_robin_and_power_of_two():
    cluster = toy_cluster(shared=False, num_nodes=3)
    choose = make_router("round_robin")
    assert [choose(cluster, request("a"), None) for _ in range(4)] == [0, 1, 2, 0]
    busy(cluster, 0, 5)
    pow2 = make_router("pow2")
    assert 0 not in {pow2(cluster, request("a"), None) for _ in range(30)}


def test_prefix_affinity_follows_what_it_routed_blind_to_evictions():
    cluster = toy_cluster(shared=False, num_nodes=3)
    choose = make_router("prefix_affinity")
    first = choose(cluster, request("a", "b"), None)
    cluster.nodes[first] = sim_cluster.SimNode([4, 0, 0], "lru")  # its cache is gone
    assert choose(cluster, request("a", "b", "c"), None) == first  # the tree still says so
    other = choose(cluster, request("x"), None)  # no match: a node with the smallest tree
    assert other != first
    busy(cluster, first, 11)  # past imbalanced_threshold: power of two over all
    assert first not in {choose(cluster, request("a", "b"), None) for _ in range(20)}


def test_dynamo_trades_overlap_against_active_blocks():
    cluster = toy_cluster(shared=False, num_nodes=2)
    cluster.nodes[1].put([k("a"), k("b")])
    choose = make_router("dynamo")
    four = request("a", "b", "c", "d")
    busy(cluster, 1, 1)  # node 1: (4 - 2) + 1 = 3 < node 0: 4 + 0
    assert choose(cluster, four, None) == 1
    busy(cluster, 1, 2)  # node 1: 2 + 3 = 5 > 4
    assert choose(cluster, four, None) == 0


def test_llmd_weights_prefix_utilisation_and_queue():
    cluster = toy_cluster(shared=False, num_nodes=2)
    cluster.nodes[1].put([k("a"), k("b")])  # half the device tier used
    choose = make_router("llmd")
    four = request("a", "b", "c", "d")
    # node 1: 3 x 0.5 + 2 x 0.5 + 2 x 1 = 4.5; node 0: 0 + 2 x 1 + 2 x 1 = 4
    assert choose(cluster, four, None) == 1
    busy(cluster, 1, 1)  # node 1's queue score falls to 0: 2.5 < 4
    assert choose(cluster, four, None) == 0


def test_raykv_and_mooncake_use_the_directory():
    cluster = toy_cluster(shared=True, num_nodes=3)
    cluster.serve(SimRequest(0.0, [k("a"), k("b")], 1024, 2), to(2))
    cluster.complete(5.0)
    late = SimRequest(5.0, [k("a"), k("b"), k("c")], 1536, 3)
    located = cluster.locate(late.keys)
    assert [sorted(p) for p in located] == [[("2", 0)], [("2", 0)]]
    assert make_router("raykv")(cluster, late, located) == Route(2, 2)
    assert make_router("mooncake")(cluster, late, located) == 2
    busy(cluster, 2, 2)
    # Waiting ~195 s there costs more than fetching the prefix over the NIC (0.5 s + 2 s)
    # or recomputing it (1 s): raykv recomputes elsewhere, Mooncake fetches elsewhere.
    assert make_router("raykv")(cluster, late, located) in (Route(0, 0), Route(1, 0))
    assert make_router("mooncake")(cluster, late, located) != 2


def test_raykv_recomputes_what_is_slower_to_fetch_and_the_cluster_honours_it():
    cluster = toy_cluster(shared=True, num_nodes=2)
    cluster.serve(SimRequest(0.0, [k("a"), k("b")], 1024, 2), to(0))
    busy(cluster, 0, 1)  # node 0 busy for 100 s: node 1 must fetch (2.5 s) or recompute (1 s)
    late = SimRequest(5.0, [k("a"), k("b"), k("c")], 1536, 3)
    choose = make_router("raykv")
    assert choose(cluster, late, cluster.locate(late.keys)) == Route(1, 0)
    assert cluster.serve(late, choose) == pytest.approx(1.536)  # all prefilled, no NIC
    assert cluster.tally.remote_bytes == 0 and choose.recomputed == 1
    fast = dataclasses.replace(TOY_NODE, nic_bytes_per_s=1e9, nic_latency_s=0.0)
    cluster.profile = fast
    again = SimRequest(10.0, [k("a"), k("b"), k("c")], 1536, 3)
    assert make_router("raykv")(cluster, again, cluster.locate(again.keys)).fetch_pages == 2


def test_scaling_replicates_sessions_with_fresh_ids():
    trace = [BlockRequest(0.0, 1024, 1, (0, 1)), BlockRequest(500.0, 1536, 1, (0, 1, 2))]
    scaled = scale_trace(trace, 3, seed=1, jitter_ms=100.0)
    assert len(scaled) == 6
    assert [r.timestamp_ms for r in scaled] == sorted(r.timestamp_ms for r in scaled)
    assert scaled[0] == trace[0]
    ids = [set(r.block_ids) for r in scaled]
    roots = {r.block_ids[0] for r in scaled}
    assert roots == {0, 3, 6}  # each copy's own root: the copies share nothing
    assert set().union(*ids) == set(range(9))
    assert scale_trace(trace, 3, seed=1, jitter_ms=100.0, until_ms=400.0) == scaled[:3]
    assert num_copies(1024, 4) == 256
    with pytest.raises(ValueError):
        num_copies(10, 4)
    # load per node stays constant: copies / nodes is fixed
    per_node = {n: num_copies(n, 4) * sum(r.input_tokens for r in trace) / n
                for n in (4, 16, 64, 256, 1024)}
    assert len(set(per_node.values())) == 1


def test_the_simulator_runs_the_services_own_objects():
    # the eviction policies: the registry the node store's Pool uses
    assert sim_cluster.make_policy is eviction.make_policy is pool.make_policy
    # the directory: the shards' index class, and the key's shard as the service computes it
    assert sim_cluster.DirectoryIndex is DirectoryIndex
    assert sim_parts.split_by_shard is handles.split_by_shard
    assert sim_parts.merge_shard_prefixes is handles.merge_shard_prefixes
    assert handles.shard_of is shard_of
    # the router: the pure functions that cluster/serving/router.py imports and calls
    for name in ("decide", "best_sources", "Candidate", "Prompt"):
        assert getattr(sim_routers, name) is getattr(cost_routing, name)
    service = ast.parse((ROOT / "cluster/serving/router.py").read_text())
    imported = {alias.name for node in ast.walk(service) if isinstance(node, ast.ImportFrom)
                and node.module == "policies.cost_routing" for alias in node.names}
    assert {"decide", "best_sources", "Candidate", "Prompt"} <= imported


def test_the_control_loop_replicates_a_hot_prefix_with_the_services_policy():
    from cluster.core.sim_control import SimControlLoop, snapshot

    cluster = toy_cluster(shared=True, num_nodes=3)
    cluster.control = loop = SimControlLoop(period_s=0.5)
    for i in range(40):  # one prefix, 10 requests a second, all served by node 0
        cluster.serve(SimRequest(i * 0.1, [k("a"), k("b")], 1025, 3), to(0))
    view = snapshot(cluster)
    assert [p.holders for p in view.prefixes if p.keys == (k("a"), k("b"))][0][0] == "0"
    assert loop.counters["passes"] >= 7 and loop.counters["copies"] >= 1
    holders = cluster.directory.shards[0].holders([k("a"), k("b")])
    assert len(holders) >= 2  # replicated to another node, which the directory knows
    assert loop.counters["bytes"] == loop.counters["copied_pages"] * cluster.page_bytes
