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

HELD = part.PREFIX_PAGES * 32  # the prefix's tokens at 32-token pages


def probe(routed_cached=(HELD,) * 3, fetch_ms=(10.0, 11.0, 30.0),
          recompute_ms=(20.0, 21.0, 5.0), condition="disk", fetch_cached=HELD,
          recompute_cached=0, status=200):
    """A probe of three rounds: the routed runs' loaded tokens, each forced kind's TTFTs."""
    return Probe(condition, 0, {
        "routed": [Run(status, 15.0, cached) for cached in routed_cached],
        "fetch": [Run(200, ms, fetch_cached) for ms in fetch_ms],
        "recompute": [Run(200, ms, recompute_cached) for ms in recompute_ms]}, HELD)


def test_a_forced_fetch_counts_by_what_the_connector_says_it_filled_not_vllm_s_count():
    # vLLM counts a load cut short at its deadline whole; the connector says it filled 0.
    cut = Probe("slow-disk", 0, {
        "routed": [Run(200, 15.0, 0)] * 3,
        "fetch": [Run(200, 900.0, HELD, 0), Run(200, 20.0, HELD, HELD),
                  Run(200, 21.0, HELD, HELD)],
        "recompute": [Run(200, 30.0, 0)] * 3}, HELD)
    assert "under 75%" in cut.why_not_counted() and cut.decisions() == []
    said_whole = Probe("slow-disk", 0, {**cut.runs, "fetch": [Run(200, 20.0, HELD, HELD)] * 3},
                       HELD)
    assert said_whole.why_not_counted() == ""
    unsaid = Probe("slow-disk", 0, {**cut.runs, "fetch": [Run(200, 20.0, HELD)] * 3}, HELD)
    assert unsaid.why_not_counted() == ""  # no word from the connector: vLLM's count


def test_each_routed_run_is_right_when_it_chose_the_faster_by_the_medians():
    # Medians: fetch 11 ms, recompute 20 ms (one run each way is an outlier).
    assert probe().decisions() == [True, True, True]
    assert probe(routed_cached=(HELD, 0, 64)).decisions() == [True, False, True]
    slow_fetch = probe(fetch_ms=(30.0, 31.0, 1.0))
    assert slow_fetch.decisions() == [False] * 3
    assert probe(routed_cached=(0, 0, 0), fetch_ms=(30.0, 31.0, 1.0)).decisions() == [True] * 3
    # A tie: a fetch is made only when it is faster, so recomputing is right.
    assert probe(routed_cached=(0,) * 3, fetch_ms=(20.0,) * 3,
                 recompute_ms=(20.0,) * 3).decisions() == [True] * 3


def test_a_probe_whose_runs_did_not_do_what_was_forced_does_not_count():
    assert "did not hold most" in probe(fetch_cached=HELD // 2).why_not_counted()
    assert probe(fetch_cached=int(HELD * 0.8)).why_not_counted() == ""
    assert "force" in probe(recompute_cached=32).why_not_counted()
    assert "failed" in probe(status=500).why_not_counted()
    assert probe(fetch_cached=0).decisions() == []


def test_the_share_counts_only_counted_decisions_and_can_fail_the_goal():
    always_fetching = [probe(condition="disk"),
                       probe(fetch_ms=(90.0,) * 3, condition="slow-disk"),
                       probe(fetch_cached=0, condition="slow-disk")]
    assert part.correct_share(always_fetching) == 0.5
    assert part.correct_share([probe(fetch_cached=0)]) is None
    summary = part.summary(always_fetching)
    assert summary["slow-disk"] == {
        "probes": 2, "counted": 1, "decisions": 3, "router_fetched": 3, "fetch_faster": 0,
        "correct_share": 0.0, "median_gap_ms": 70.0, "min_gap_ms": 70.0,
        "not_counted": [probe(fetch_cached=0).why_not_counted()]}
    assert summary["all"]["counted"] == 2 and summary["all"]["decisions"] == 6
    assert part.per_round(always_fetching) == {"disk": [1.0, 1.0, 1.0],
                                               "slow-disk": [0.0, 0.0, 0.0]}
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    vllm_serve.fill_ratios(report, {}, vllm_serve.QUICK_PLAN, [2000],
                           {"share": 0.5, "summary": summary}, ("recompute",))
    assert report.ratios == {"recompute_decisions_correct": 0.5}  # the part's only
    met = goals_met(report.ratios, vllm_serve.GOALS)
    assert met["recompute_decisions_correct"] is False


def test_a_run_of_the_recompute_part_alone_has_only_its_goal():
    assert vllm_serve.goals_for(("recompute",)) == {
        "recompute_decisions_correct": vllm_serve.GOALS["recompute_decisions_correct"]}
    assert vllm_serve.goals_for(vllm_serve.PARTS) == vllm_serve.GOALS


def test_no_counted_probe_leaves_the_ratio_not_exercised():
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    summary = part.summary([probe(fetch_cached=0)])
    vllm_serve.fill_ratios(report, {}, vllm_serve.QUICK_PLAN, [2000],
                           {"share": None, "summary": summary}, ("recompute",))
    assert report.ratios["recompute_decisions_correct"] is None
    assert "did not hold most" in report["not_exercised"]["recompute_decisions_correct"]


def test_a_flush_comes_before_a_run_only_where_a_load_may_have_left_the_prefix_in_host(
        monkeypatch):
    sent = []
    answers = iter([Run(200, 1.0, 0), Run(200, 1.0, HELD), Run(200, 1.0, 0),
                    Run(200, 1.0, 0), Run(200, 1.0, 0), Run(200, 1.0, 0)])

    def fake_send(url, model, prompt, forced):
        sent.append(("flush" if prompt.startswith(part.flush_text(len(
            [s for s in sent if s[0] == "flush"]), 32)[:64]) else "run", forced))
        return Run(200, 1.0, 0) if sent[-1][0] == "flush" else next(answers)

    monkeypatch.setattr(part, "send", fake_send)
    monkeypatch.setattr(part, "FLUSH_SETTLE_S", 0.0)
    prober = part.Prober("http://x", "m", 32, random.Random(0))
    text = part.prefix_text(0, 0, 32)
    for kind in ("recompute", "fetch", "routed", "routed"):
        prober.run(text, kind)
    # A flush first (the state is unknown), none after a run that loaded nothing, one after
    # the forced fetch (it loaded the prefix into host).
    assert [s[0] for s in sent] == ["flush", "run", "run", "flush", "run", "run"]
    assert [forced for kind, forced in sent if kind == "flush"] == [0, 0]


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
                           {"error": "TimeoutError: no /v1/models"}, ("recompute",))
    assert report.ratios["recompute_decisions_correct"] is None
    assert "TimeoutError" in report["not_exercised"]["recompute_decisions_correct"]
