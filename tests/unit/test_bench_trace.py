"""`raykv bench trace`'s pure parts: a trace block as a few tokens of text (prefixes exact,
distinct blocks distinct), time compression, the error arithmetic and the ratios, and the
simulator's configuration derived from the live one. No Ray."""

import statistics

import pytest

from cluster.core.config import CacheConfig
from cluster.core.geometry import PageGeometry
from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import BLOCK_TOKENS, BlockRequest
from cluster.core.trace_scale import (
    ALPHABET,
    Scale,
    block_text,
    check_distinct,
    compress_s,
    hit_errors,
    scale_request,
    scale_trace,
)
from cluster.serving import tokenizer
from cluster.serving.vllm_plan import LOADED_KEY, UNFILLED_KEY
from cluster.tools.bench import trace, trace_sim
from cluster.tools.bench.harness import Report

SCALE = Scale(page_tokens=8, speedup=4.0, lead_tokens=len(tokenizer.encode("")))


def request(ids, input_tokens=None, at_ms=0.0) -> BlockRequest:
    tokens = input_tokens if input_tokens is not None else len(ids) * BLOCK_TOKENS - 100
    return BlockRequest(at_ms, tokens, 10, tuple(ids))


def live_keys(text: str, scale: Scale = SCALE) -> list:
    """The page keys the live service computes for a prompt (its tokenizer, its chain)."""
    chain = KeyChain.of(ModelSpec.preset(trace.MODEL), "default", scale.page_tokens)
    return chain.keys(tokenizer.encode(text))


def shared_prefix(a, b) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def test_a_block_is_page_tokens_one_byte_characters_fixed_by_its_id():
    text = block_text(7, SCALE.page_tokens)
    assert text == block_text(7, SCALE.page_tokens) != block_text(8, SCALE.page_tokens)
    assert len(text) == len(text.encode()) == SCALE.page_tokens
    assert set(text) <= set(ALPHABET)
    assert block_text(7, 3) == text[:3]  # a tail is the block's own start


def test_shared_leading_blocks_are_exactly_the_shared_leading_pages_of_the_live_prompt():
    trie = [request([0, 1, 2, 3, 4]), request([0, 1, 2, 9, 10, 11]), request([0, 1, 2]),
            request([0, 5]), request([6, 1, 2, 3]), request([0, 1, 2, 3, 4, 12], 6 * 512)]
    scaled = [scale_request(i, r, 0.0, SCALE) for i, r in enumerate(trie)]
    keys = [live_keys(s.text) for s in scaled]
    for s, r, k in zip(scaled, trie, keys, strict=True):
        assert len(k) == s.num_full_blocks == r.input_tokens // BLOCK_TOKENS
    for i, (a, ka) in enumerate(zip(scaled, keys, strict=True)):
        for b, kb in zip(scaled[i + 1:], keys[i + 1:], strict=True):
            full = min(a.num_full_blocks, b.num_full_blocks)
            blocks = shared_prefix(a.block_ids[:full], b.block_ids[:full])
            assert shared_prefix(ka, kb) == blocks, (a.block_ids, b.block_ids)


def test_distinct_blocks_stay_distinct_and_a_collision_is_caught():
    many = [scale_request(i, request([i, 100_000 + i], 1024), 0.0, SCALE) for i in range(2000)]
    assert check_distinct(many, SCALE) == 4000
    tiny = Scale(page_tokens=2, lead_tokens=1)  # a page sees one character of a block
    crowded = [scale_request(i, request([i], 512), 0.0, tiny) for i in range(100)]
    with pytest.raises(ValueError, match="share their first 1 characters"):
        check_distinct(crowded, tiny)


@pytest.mark.parametrize("input_tokens", [512, 513, 700, 1000, 1023, 1024, 1535])
def test_every_full_block_is_a_page_the_engine_can_hit_and_the_tail_never_is(input_tokens):
    r = scale_request(0, request([1, 2, 3], input_tokens), 0.0, SCALE)
    page = SCALE.page_tokens
    assert r.prompt_tokens == SCALE.lead_tokens + len(r.text) == len(tokenizer.encode(r.text))
    assert r.prompt_tokens // page == r.num_full_blocks == input_tokens // BLOCK_TOKENS
    # the engine leaves at least one token to prefill, and still reaches every full page
    assert (r.prompt_tokens - 1) // page == r.num_full_blocks
    rest = input_tokens - r.num_full_blocks * BLOCK_TOKENS
    tail = len(r.text) - r.num_full_blocks * page
    assert tail == min(round(rest * page / BLOCK_TOKENS), page - 1 - SCALE.lead_tokens)


def test_time_is_compressed_from_the_first_request():
    assert compress_s(31_000, 1_000, 4.0) == pytest.approx(7.5)
    scaled = scale_trace([request([1], at_ms=2_000), request([1, 2], at_ms=6_000)], SCALE)
    assert [s.send_at_s for s in scaled] == [0.0, 1.0]
    assert [s.index for s in scaled] == [0, 1]


def test_a_scale_must_page_the_block_evenly():
    for bad in ({"page_tokens": 24}, {"page_tokens": 1}, {"page_tokens": 8, "speedup": 0},
                {"page_tokens": 8, "lead_tokens": 8}):
        with pytest.raises(ValueError):
            Scale(**bad)
    assert SCALE.tokens_per_live_token == 64


def test_the_simulator_gets_the_live_capacities_router_and_eviction():
    plan = trace.plan_for(False)
    config = trace.cache_config(plan, "/tmp/unused")
    assert config.device_bytes == config.disk_bytes == 0
    assert PageGeometry.of(ModelSpec.preset(trace.MODEL), plan.page_tokens).slot_bytes == \
        plan.page_bytes
    assert config.host_bytes // plan.page_bytes == plan.pages_per_node
    local = trace.app_args("local-pow2", plan)["local_cache"]
    assert local == {"page_tokens": plan.page_tokens, "capacity_bytes": config.host_bytes}
    assert trace.app_args("raykv", plan)["local_cache"] is None
    setups = {name: trace.sim_setup(name, plan) for name in trace.CONTENDERS}
    assert setups["raykv"] == trace_sim.SimSetup(
        "raykv", True, CacheConfig().eviction, (0, plan.pages_per_node, 0),
        CacheConfig().rebalance_period_s)
    assert setups["local-pow2"].router == "pow2"
    assert setups["local-prefix"].router == "prefix_affinity"
    for name in trace.LOCAL:
        assert setups[name].capacities_pages == (0, plan.pages_per_node, 0)
        assert not setups[name].shared and setups[name].eviction == "lru"
    fit = trace_sim.EngineFit(0.01, 1e-4)
    for setup in setups.values():
        profile = trace_sim.fitted_profile(setup, fit, plan.scale, plan.page_bytes)
        cluster = trace_sim.make_cluster(setup, profile, plan.page_bytes)
        assert tuple(cluster.capacities) == setup.capacities_pages
        assert cluster.shared == setup.shared


def test_service_times_leave_out_the_queue_of_each_replica():
    # replica a: sent at 0 and 0.1, answered at 1.0 and 1.5 (the second waited for the first);
    # replica b: sent at 2.0, answered at 2.4, then sent at 5.0 (idle meanwhile), at 5.3
    sent = [0.0, 0.1, 2.0, 5.0]
    ttft = [1.0, 1.4, 0.4, 0.3]
    times = trace_sim.service_times(sent, ttft, ["a", "a", "b", "b"])
    assert times == pytest.approx([1.0, 0.5, 0.4, 0.3])


def test_the_fitted_engine_takes_the_live_time_per_uncached_token():
    sizes = [100, 200, 300, 400, 500] * 4
    # each size: the engine's own time, and three more that queued behind others
    waits = [0.0] * 5 + [0.5] * 5 + [1.0] * 5 + [2.0] * 5
    ttft = [0.05 + 1e-3 * size + wait for size, wait in zip(sizes, waits, strict=True)]
    fit = trace_sim.fit_engine(sizes, ttft, quantile=0.0)
    assert fit.overhead_s == pytest.approx(0.05) and fit.per_token_s == pytest.approx(1e-3)
    middle = trace_sim.fit_engine(sizes, ttft)  # the median: between the two middle waits
    assert middle.per_token_s == pytest.approx(1e-3)
    assert middle.overhead_s == pytest.approx(0.05 + statistics.median(waits))
    assert trace_sim.fit_engine([100, 200], [0.3, 0.1]).per_token_s == 0.0
    setup = trace.sim_setup("raykv", trace.plan_for(True))
    profile = trace_sim.fitted_profile(setup, fit, SCALE, 8 * 4096)
    # 100 live tokens uncached = 6,400 trace tokens
    assert profile.prefill_s(None, 0, 100 * SCALE.tokens_per_live_token) == pytest.approx(0.15)
    # raykv's cost router (the simulator's raykv) reads the same fitted rate
    assert profile.prefill_tokens_per_s(None) == pytest.approx(
        1.0 / profile.per_trace_token_s)


def test_the_simulated_hit_ratio_is_cached_over_prompt_tokens_of_the_scaled_prompts():
    plan = trace.plan_for(True)
    first = scale_request(0, request([0, 1, 2], 1400), 0.0, plan.scale)
    second = scale_request(1, request([0, 1, 5, 6], 1900, at_ms=10_000), 0.0, plan.scale)
    sims = trace_sim.sim_requests([first, second], plan.scale, trace.MODEL, [0.0, 5.0])
    assert [len(s.keys) for s in sims] == [2, 3]
    assert sims[1].arrival_s == 5.0
    for name in trace.CONTENDERS:
        out = trace_sim.simulate(trace.sim_setup(name, plan), trace_sim.EngineFit(0.01, 0.0),
                                 plan.scale, plan.page_bytes, sims)
        # the second shares two full blocks with the first, finished long before: a hit
        # wherever it goes on shared tiers, or where the prefix router sends it (the first's
        # node); power of two may send it elsewhere
        expected = 2 * plan.page_tokens / (first.prompt_tokens + second.prompt_tokens)
        hits = [pytest.approx(expected)] + ([0.0] if name == "local-pow2" else [])
        assert out["hit_ratio"] in hits, name


def live_round(hit: float, p50: float, p99: float, evicted: int = 10) -> dict:
    summary = {"requests": 100, "ok": 100, "hit_ratio": hit, "cached_tokens": 5,
               "ttft_p50_ms": p50, "ttft_p99_ms": p99}
    return {"summary": summary, "evicted_pages": evicted}


def test_the_error_is_the_median_absolute_difference_and_locals_are_the_best_per_round():
    assert hit_errors([0.10, 0.20], [0.12, 0.15]) == pytest.approx([0.02, 0.05])
    rounds = {"raykv": [live_round(0.08, 100, 400), live_round(0.07, 120, 300),
                        live_round(0.09, 90, 500)],
              "local-pow2": [live_round(0.04, 80, 800), live_round(0.05, 200, 600),
                             live_round(0.03, 100, 1000)],
              "local-prefix": [live_round(0.06, 200, 500), live_round(0.035, 100, 900),
                               live_round(0.045, 120, 250)]}
    simulated = {"raykv": [{"hit_ratio": h} for h in (0.09, 0.04, 0.085)],
                 "local-pow2": [{"hit_ratio": h} for h in (0.04, 0.05, 0.03)],
                 "local-prefix": [{"hit_ratio": h} for h in (0.06, 0.035, 0.045)]}
    report = Report("trace", "", {}, trace.GOALS)
    trace.fill_ratios(report, rounds, simulated)
    ratios = report.ratios
    assert ratios["sim_vs_live_hit_error"] == pytest.approx(0.01)  # 0.01, 0.03, 0.005
    assert report["spread"]["sim_vs_live_hit_error"]["max"] == pytest.approx(0.03)
    assert ratios["sim_vs_live_hit_error_local_pow2"] == pytest.approx(0.0)
    assert ratios["trace_hit_vs_local"] == pytest.approx(1.4)  # 1.33, 1.4, 2
    assert ratios["trace_ttft_p50_vs_local"] == pytest.approx(1.2)  # 1.25, 1.2, 0.9
    assert ratios["trace_ttft_p99_vs_local"] == pytest.approx(0.8)  # 0.8, 0.5, 2


def test_a_run_whose_raykv_caches_never_evicted_or_answered_too_little_is_not_exercised():
    ok = [live_round(0.1, 1, 1) for _ in range(3)]
    never = {"raykv": [live_round(0.1, 1, 1, evicted=0)] * 3, "local-pow2": ok,
             "local-prefix": ok}
    assert "evicted nothing" in trace.exercised(never)
    failing = dict(never, raykv=ok, **{"local-pow2": [dict(live_round(0.1, 1, 1),
                                                           summary={**ok[0]["summary"],
                                                                    "ok": 50})] * 3})
    assert "answered 50 of 100" in trace.exercised(failing)
    report = Report("trace", "", {}, trace.GOALS)
    trace.fill_ratios(report, never, {})
    assert report.ratios["sim_vs_live_hit_error"] is None


def test_an_answer_s_cached_tokens_leave_out_what_raykv_s_loads_did_not_fill():
    usage = {"prompt_tokens": 200, "prompt_tokens_details": {"cached_tokens": 160}}
    cut = trace.Sent(0)
    trace._read_answer(cut, {"usage": usage, "kv_transfer_params": {
        LOADED_KEY: 32, UNFILLED_KEY: 128}})
    assert (cut.cached_tokens, cut.unfilled_tokens) == (32, 128)
    plain = trace.Sent(1)  # another router's engine: no word from raykv's connector
    trace._read_answer(plain, {"usage": usage, "kv_transfer_params": None})
    assert (plain.cached_tokens, plain.unfilled_tokens) == (160, 0)
    odd = trace.Sent(2)
    trace._read_answer(odd, {"usage": usage, "kv_transfer_params": {UNFILLED_KEY: "128"}})
    assert odd.cached_tokens == 160
