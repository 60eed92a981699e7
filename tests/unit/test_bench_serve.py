"""`raykv bench serve`'s pure parts: the plans, the stronger local baseline per round, the
paired ratios, and the runs that exercised nothing. No Ray."""

import pytest

from cluster.tools.bench import serve
from cluster.tools.bench.harness import Report


def figures(p50: float, p99: float, cached: int, evicted: int = 5, shares=(0.4, 0.3, 0.3)):
    summary = {"ok": 10, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "cached_tokens": cached,
               "replica_shares": dict(zip("abc", shares, strict=True))}
    return {"summary": summary, "evicted_pages": evicted}


def rounds_of(**per_contender):
    return {name: per_contender[name.replace("-", "_")] for name in serve.CONTENDERS}


def report() -> Report:
    return Report("serve", "ms", {}, serve.GOALS)


def test_the_plans_give_each_replica_the_memory_of_its_nodes_tiers_and_enough_requests():
    for quick in (False, True):
        plan = serve.plan_for(quick)
        assert plan.num_rounds >= 3
        assert plan.local_cache_bytes == plan.host_bytes + plan.disk_bytes
        assert serve.app_args("local-pow2", plan)["local_cache"]["capacity_bytes"] == \
            plan.local_cache_bytes
        assert serve.app_args("raykv", plan)["local_cache"] is None
    full = serve.plan_for(False)
    assert full.shape.num_sessions * full.shape.turns_per_session * full.num_rounds >= 300


def test_every_round_is_a_fresh_set_of_sessions_of_the_same_shape():
    plan = serve.plan_for(True)
    first, second = serve.round_trace(plan, 0), serve.round_trace(plan, 1)
    assert len(first) == len(second) == plan.shape.num_sessions
    assert {s.system for s in first}.isdisjoint({s.system for s in second})
    assert [s.users for s in first] == [s.users for s in serve.round_trace(plan, 0)]


def test_raykv_is_paired_with_each_rounds_stronger_local_contender():
    rounds = rounds_of(
        raykv=[figures(50, 100, 300), figures(60, 90, 300), figures(40, 80, 400)],
        prefix=[figures(100, 200, 300), figures(60, 100, 300), figures(80, 80, 400)],
        local_pow2=[figures(100, 400, 100), figures(300, 500, 50), figures(90, 100, 100)],
        local_prefix=[figures(200, 100, 150), figures(100, 200, 200), figures(80, 400, 200)])
    assert [serve.stronger_local(rounds, i) for i in range(3)] == \
        ["local-pow2", "local-prefix", "local-prefix"]
    result = report()
    serve.fill_ratios(result, rounds)
    ratios = result.ratios
    assert ratios["ttft_p50_vs_local_prefix"] == pytest.approx(0.5)  # 0.5, 0.6, 0.5
    assert ratios["ttft_p99_vs_local_prefix"] == pytest.approx(0.25)  # 0.25, 0.45, 0.2
    assert ratios["cached_tokens_vs_local_prefix"] == pytest.approx(2.0)  # 3, 1.5, 2
    assert ratios["ttft_p50_vs_prefix_router"] == pytest.approx(0.5)  # 0.5, 1, 0.5
    assert ratios["max_replica_share"] == pytest.approx(0.4)
    assert result["spread"]["ttft_p50_vs_local_prefix"]["rounds"] == [0.5, 0.6, 0.5]
    assert set(ratios) == set(serve.GOALS) and not result["not_exercised"]


def test_a_baseline_that_cached_nothing_or_never_evicted_fails_its_ratios():
    good = [figures(50, 100, 300)] * 3
    rounds = rounds_of(raykv=good, prefix=good, local_pow2=[figures(90, 100, 0)] * 3,
                       local_prefix=good)
    result = report()
    serve.fill_ratios(result, rounds)
    assert result.ratios["ttft_p50_vs_local_prefix"] is None
    assert "local-pow2 cached no token in round 0" in \
        result["not_exercised"]["cached_tokens_vs_local_prefix"]
    assert result.ratios["ttft_p50_vs_prefix_router"] == 1.0
    roomy = rounds_of(raykv=good, prefix=[figures(50, 100, 300, evicted=0)] * 3,
                      local_pow2=good, local_prefix=good)
    result = report()
    serve.fill_ratios(result, roomy)
    assert result.ratios["ttft_p50_vs_prefix_router"] is None
    assert "evicted nothing" in result["not_exercised"]["ttft_p50_vs_prefix_router"]
    assert result.ratios["ttft_p50_vs_local_prefix"] == 1.0


def test_evicted_pages_count_the_local_lrus_or_every_tier_of_raykv():
    assert serve.evicted_pages({"local_cache.evicted_pages": 7, "engine.requests": 3}) == 7
    assert serve.evicted_pages({"node.evictions.host": 4, "node.evictions.disk": 2,
                                "node.hits_host": 9}) == 6
    totals = {}
    serve._add(totals, "engine", {"requests": 2, "replica": "r1", "ok": True})
    serve._add(totals, "engine", {"requests": 3, "clients": {}})
    assert totals == {"engine.requests": 5}
