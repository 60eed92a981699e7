"""`raykv sim --part fig10`: Mooncake's Fig. 10 setting (10 nodes x 3M tokens of DRAM), its
capacity arithmetic, the paper's local router, the per-request hit ratio, the figures, and the
part on a small trace. No Ray."""

from __future__ import annotations

import json

import pytest

from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.sim_cluster import SimCluster, SimNode, SimRequest
from cluster.core.sim_profiles import PROFILES, dram_only, llama3_70b
from cluster.core.sim_routers import make_router
from cluster.tools import sim, sim_fig10
from tests.unit.test_sim import write_trace
from tests.unit.test_sim_cluster import TOY, TOY_NODE, busy, k, request, to, toy_cluster


def test_three_million_tokens_of_llama3_70b_are_5859_blocks_of_dram_only():
    model = llama3_70b()
    assert model.kv_bytes_per_token == 320 * 1024  # the paper's 320 KB a token
    profile = sim_fig10.fig10_profile()
    cluster = SimCluster(profile, model, 10, "lru")
    assert cluster.capacities == [0, 5859, 0]  # 3,000,000 // 512, all in DRAM (host)
    assert 5859 * 512 <= 3_000_000 < 5860 * 512
    assert 0.98e12 < profile.host_kv_bytes < 1e12  # "approximately 1TB of DRAM"
    # compute and links are the H100 profile's
    assert profile.dense_flops == PROFILES["h100-400g"].dense_flops
    assert profile.nic_bytes_per_s == PROFILES["h100-400g"].nic_bytes_per_s


def test_a_dram_only_node_fills_host_and_drops_what_overflows():
    profile = dram_only(TOY_NODE, TOY, 3 * 512, 512)  # 3 blocks of DRAM, 512 B a block
    cluster = SimCluster(profile, TOY, 1, "lru")
    assert cluster.capacities == [0, 3, 0]
    node = cluster.nodes[0]
    node.put([k("a"), k("b")])
    assert set(node.tier_of.values()) == {HOST}
    node.put([k("c"), k("d")])  # a, the oldest, has no tier below to go to
    assert sorted(node.tier_of) == [k("b"), k("c"), k("d")]
    assert node.acquire([k("b")]) == [HOST]  # no device tier: nothing to promote into
    assert node.tier_of[k("b")] == HOST and node.counts == [0, 3, 0]
    assert SimNode([0, 2, 0], "lru").put([k("x"), k("y"), k("z")]) == 2
    assert DISK not in node.tier_of.values() and DEVICE not in node.tier_of.values()


def test_prefix_match_routes_to_the_longest_own_prefix_then_the_shorter_queue():
    cluster = toy_cluster(shared=False, num_nodes=3)
    choose = make_router("prefix_match")
    cluster.nodes[1].put([k("a")])
    cluster.nodes[2].put([k("a"), k("b")])
    busy(cluster, 2, 5)
    assert choose(cluster, request("a", "b", "c"), None) == 2  # the longest, however busy
    assert choose(cluster, request("a", "x"), None) == 1  # a tie at one page: shorter queue
    busy(cluster, 0, 1)
    assert choose(cluster, request("z"), None) == 1  # no match anywhere: the shortest queue


def test_the_mean_of_per_request_hit_ratios_is_kept_beside_the_token_ratio():
    cluster = toy_cluster(shared=False, num_nodes=1)
    cluster.serve(SimRequest(0.0, [k("a"), k("b")], 1024, 2), to(0))
    cluster.serve(SimRequest(5.0, [k("a"), k("b"), k("c"), k("d")], 2048, 4), to(0))
    # 2 of 4 blocks hit on the second request: tokens 1024 / 3072; requests (0 + 0.5) / 2
    assert cluster.tally.hit_tokens / cluster.tally.input_tokens == pytest.approx(1 / 3)
    assert cluster.tally.request_hit_sum / len(cluster.tally.ttft_s) == pytest.approx(0.25)


def test_pooled_is_one_cache_of_the_whole_capacity():
    requests = [SimRequest(0.0, [k("a"), k("b")], 1024, 2),
                SimRequest(1.0, [k("a"), k("c")], 1536, 3),
                SimRequest(2.0, [k("a"), k("b")], 1024, 2)]
    out = sim_fig10.pooled(requests, 2, "lru")
    # a b | a hit, c evicts b | a hit, b evicts c
    assert out["hit_ratio"] == pytest.approx(2 * 512 / 3584)
    assert out["request_hit_ratio_mean"] == pytest.approx((0 + 512 / 1536 + 0.5) / 3)


def test_the_figures_take_the_papers_router_and_raykvs_global_cache():
    def run(hit, mean):
        return {"hit_ratio": hit, "request_hit_ratio_mean": mean}

    fig10 = {"local_router": "prefix_match", "global_router": "raykv",
             "paper": dict(sim_fig10.PAPER), "policies": {
                 "lru": {"local": {"prefix_match": run(0.1, 0.2), "round_robin": run(0.05, 0.1)},
                         "global": {"raykv": run(0.3, 0.35)}},
                 sim_fig10.default_policy(): {
                     "local": {"prefix_match": run(0.2, 0.25)},
                     "global": {"raykv": run(0.3, 0.4)}}}}
    figures = sim_fig10.fig10_figures(fig10)
    assert figures["fig10_local_hit_ratio_lru"] == 0.1
    assert figures["fig10_global_over_local_lru"] == pytest.approx(3.0)
    assert figures["fig10_local_hit_ratio"] == 0.2
    assert figures["fig10_global_request_hit_ratio_mean"] == 0.4
    assert figures["fig10_global_over_local"] == pytest.approx(1.5)
    assert (figures["fig10_paper_local_hit_ratio"], figures["fig10_paper_global_hit_ratio"]) \
        == (0.169, 0.375)


def test_the_part_on_a_small_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(sim_fig10, "FIG10_TOKENS_PER_NODE", 512 * 40)  # caches that evict
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, num_requests=200)
    out = tmp_path / "sim.json"
    result = sim.run(str(trace), str(out), str(tmp_path / "sim.png"), ("fig10",))
    written = json.loads(out.read_text())
    requests, chains = sim.trace_chains(str(trace))
    unlimited = sim.unlimited_hits(chains) * 512 / sum(r.input_tokens for r in requests)
    fig10 = written["fig10"]
    assert fig10["blocks_per_node"] == 40 and fig10["num_nodes"] == 10
    assert set(fig10["policies"]) == {"lru", sim_fig10.default_policy()}
    for runs in fig10["policies"].values():
        assert set(runs["local"]) == set(sim_fig10.LOCAL_ROUTERS)
        assert set(runs["global"]) == {"raykv"}
        assert runs["pooled"]["capacity_blocks"] == 400
        for figures in [*runs["local"].values(), *runs["global"].values(), runs["pooled"]]:
            assert 0.0 < figures["hit_ratio"] <= unlimited + 1e-12  # no cache beats unlimited
        assert runs["local"]["prefix_match"]["hit_ratio"] > runs["local"]["round_robin"][
            "hit_ratio"]  # conversations that stay on their node hit there
        assert all(f["cross_node_bytes"] == 0 for f in runs["local"].values())
    assert written["figures"] == sim_fig10.fig10_figures(fig10)
    # figures, no goal; and the hit bound's goal, measured where the capacity forces eviction
    assert set(result["ratios"]) == {"sim_hit_vs_global_bound"}
    assert result["ratios"]["sim_hit_vs_global_bound"] == pytest.approx(
        sim_fig10.fig10_ratios(fig10)["sim_hit_vs_global_bound"])
    assert (tmp_path / "sim.png").stat().st_size > 10_000
