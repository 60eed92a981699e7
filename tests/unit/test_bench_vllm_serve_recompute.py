"""`raykv bench vllm-serve`'s recompute part, its pure parts: which probes count, when the
router chose right, the share, the prompts' pages and the ratio's goal (no Ray, no vLLM)."""

from __future__ import annotations

import random

from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.serving import tokenizer
from cluster.tools.bench import vllm_serve
from cluster.tools.bench import vllm_serve_recompute as part
from cluster.tools.bench.harness import Report, goals_met
from cluster.tools.bench.vllm_serve_recompute import KINDS, Probe, Run


def probe(routed_cached=64, fetch_ms=10.0, recompute_ms=20.0, condition="disk",
          fetch_cached=64, recompute_cached=0, status=200):
    return Probe(condition, 0, KINDS, {
        "routed": Run(status, 15.0, routed_cached),
        "fetch": Run(200, fetch_ms, fetch_cached),
        "recompute": Run(200, recompute_ms, recompute_cached)})


def test_the_router_is_right_when_it_chose_the_faster_of_both_runs():
    assert probe(routed_cached=64, fetch_ms=10, recompute_ms=20).correct() is True
    assert probe(routed_cached=64, fetch_ms=30, recompute_ms=20).correct() is False
    assert probe(routed_cached=0, fetch_ms=30, recompute_ms=20).correct() is True
    assert probe(routed_cached=0, fetch_ms=10, recompute_ms=20).correct() is False
    # A tie: a fetch is made only when it is faster, so recomputing is right.
    assert probe(routed_cached=0, fetch_ms=20, recompute_ms=20).correct() is True


def test_a_probe_whose_runs_did_not_do_what_was_forced_does_not_count():
    assert "nothing" in probe(fetch_cached=0).why_not_counted()
    assert "force" in probe(recompute_cached=32).why_not_counted()
    assert "failed" in probe(status=500).why_not_counted()
    assert probe(fetch_cached=0).correct() is None


def test_the_share_counts_only_counted_probes_and_can_fail_the_goal():
    always_fetching = [probe(fetch_ms=10, recompute_ms=20, condition="disk"),
                       probe(fetch_ms=90, recompute_ms=20, condition="slow-disk"),
                       probe(fetch_cached=0, condition="slow-disk")]
    assert part.correct_share(always_fetching) == 0.5
    assert part.correct_share([probe(fetch_cached=0)]) is None
    summary = part.summary(always_fetching)
    assert summary["slow-disk"] == {"probes": 2, "counted": 1, "router_fetched": 1,
                                    "fetch_faster": 0, "correct_share": 0.0,
                                    "not_counted": [probe(fetch_cached=0).why_not_counted()]}
    assert summary["all"]["counted"] == 2
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    vllm_serve.fill_ratios(report, {}, vllm_serve.QUICK_PLAN, [2000],
                           {"share": 0.5, "summary": summary})
    assert report.ratios["recompute_decisions_correct"] == 0.5
    met = goals_met(report.ratios, vllm_serve.GOALS)
    assert met["recompute_decisions_correct"] is False


def test_no_counted_probe_leaves_the_ratio_not_exercised():
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    summary = part.summary([probe(fetch_cached=0)])
    vllm_serve.fill_ratios(report, {}, vllm_serve.QUICK_PLAN, [2000],
                           {"share": None, "summary": summary})
    assert report.ratios["recompute_decisions_correct"] is None
    assert "raykv held none" in report["not_exercised"]["recompute_decisions_correct"]


def test_each_kind_runs_first_second_and_third_equally_often():
    orders = [part.rotated(i) for i in range(len(KINDS))]
    for position in range(len(KINDS)):
        assert sorted(o[position] for o in orders) == sorted(KINDS)


def test_a_probe_s_prompts_share_exactly_the_prefix_s_pages():
    page = 32
    spec = ModelSpec("small-llama", 4, 2, 64, "float32")
    chain = KeyChain.of(spec, "default", page)
    rng = random.Random(0)
    text = part.prefix_text(1, 2, page)
    one, two = (tokenizer.encode(text + part.suffix(rng)) for _ in range(2))
    assert len(one) == len(tokenizer.encode("")) + part.PREFIX_PAGES * page + part.SUFFIX_CHARS
    keys_one, keys_two = chain.keys(one), chain.keys(two)
    assert len(keys_one) == part.PREFIX_PAGES and keys_one == keys_two
    other = chain.keys(tokenizer.encode(part.prefix_text(1, 3, page) + part.suffix(rng)))
    assert other[0] != keys_one[0]  # another prefix shares nothing


def test_a_failed_part_is_not_exercised_and_says_why():
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    vllm_serve.fill_ratios(report, {}, vllm_serve.QUICK_PLAN, [2000],
                           {"error": "TimeoutError: no /v1/models"})
    assert report.ratios["recompute_decisions_correct"] is None
    assert "TimeoutError" in report["not_exercised"]["recompute_decisions_correct"]
