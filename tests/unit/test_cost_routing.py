"""Cost-based routing (policies/cost_routing.py): the TTFT estimate, the fetch-or-recompute
cut, the choice of replica and the online rates."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.cost_routing import (
    DEVICE,
    DISK,
    ENGINE,
    HOST,
    PRIOR_PREFILL_TOKENS_PER_S,
    REMOTE,
    SOURCES,
    Candidate,
    PathRate,
    Prompt,
    RateEstimates,
    best_sources,
    decide,
    estimate_ttft,
    merge_paths,
    observe_prefill,
    observe_transfer,
    pooled,
    prefill_s,
    prior_rates,
    published,
)

PAGE_TOKENS, PAGE_BYTES = 16, 1 << 20


def rates_with(prefill_tokens_per_s: float, **bytes_per_s: float) -> RateEstimates:
    paths = {name: (bytes_per_s.get(name, 1e12), 0.0) for name in SOURCES if name != ENGINE}
    return prior_rates(paths, prefill_tokens_per_s)


def brute_force_s(candidate: Candidate, prompt: Prompt, rates: RateEstimates) -> float:
    """Every cut tried, each one's cost summed afresh."""
    usable = min(len(candidate.sources), (prompt.num_tokens - 1) // prompt.page_tokens)
    costs = []
    for k in range(usable + 1):
        used = candidate.sources[:k]
        fetch = sum(rates.paths[s].latency_s for s in set(used))
        fetch += sum(prompt.page_bytes / rates.paths[s].bytes_per_s for s in used)
        costs.append(fetch + rates.prefill_s(prompt, k, candidate.replica_id))
    return candidate.queue_wait_s + min(costs)


# ---- fetch or recompute -----------------------------------------------------------------


def test_a_slow_tier_is_recomputed_and_a_fast_one_fetched():
    prompt = Prompt(10 * PAGE_TOKENS, PAGE_TOKENS, PAGE_BYTES)
    # Prefill: 1,000 tokens/s, so a page costs 16 ms to recompute. Disk at 10 MB/s takes
    # ~105 ms a page; host at 10 GB/s ~0.1 ms.
    rates = rates_with(1_000.0, disk=10e6, host=10e9)
    slow = estimate_ttft(Candidate("a", (DISK,) * 8, 0.0), prompt, rates)
    fast = estimate_ttft(Candidate("a", (HOST,) * 8, 0.0), prompt, rates)
    assert slow.fetch_pages == 0 and slow.fetch_s == 0.0
    assert slow.ttft_s == pytest.approx(160 / 1_000.0)
    assert fast.fetch_pages == 8
    assert fast.ttft_s == pytest.approx(8 * PAGE_BYTES / 10e9 + 32 / 1_000.0)
    decision = decide(prompt, [Candidate("a", (DISK,) * 8, 0.0)], rates)
    assert decision.recompute and decision.fetch_pages == 0 and decision.num_cached_pages == 8


def test_the_cut_fetches_the_fast_head_and_recomputes_the_slow_tail():
    prompt = Prompt(10 * PAGE_TOKENS, PAGE_TOKENS, PAGE_BYTES)
    rates = rates_with(1_000.0, disk=10e6, host=10e9)
    estimate = estimate_ttft(Candidate("a", (HOST, HOST, HOST, DISK, DISK), 0.5), prompt, rates)
    assert estimate.fetch_pages == 3
    assert estimate.queue_wait_s == 0.5
    assert estimate.ttft_s == pytest.approx(0.5 + 3 * PAGE_BYTES / 10e9 + 112 / 1_000.0)


@settings(max_examples=200, deadline=None)
@given(page_tokens=st.integers(1, 512), page_bytes=st.integers(1, 1 << 30),
       tokens_per_s=st.floats(10.0, 1e6), num_pages=st.integers(1, 40),
       source=st.sampled_from([DEVICE, HOST, DISK, REMOTE]))
def test_the_decision_flips_exactly_where_fetch_and_recompute_cost_the_same(
        page_tokens, page_bytes, tokens_per_s, num_pages, source):
    """No hand-set threshold: a page's fetch is worth it iff page_bytes / bw < page_tokens /
    prefill rate. A hair either side of the break-even bandwidth flips the cut."""
    prompt = Prompt((num_pages + 1) * page_tokens, page_tokens, page_bytes)
    even_bw = page_bytes * tokens_per_s / page_tokens
    candidate = Candidate("r", (source,) * num_pages, 0.0)
    faster = estimate_ttft(candidate, prompt, rates_with(tokens_per_s, **{source: even_bw
                                                                        * 1.001}))
    slower = estimate_ttft(candidate, prompt, rates_with(tokens_per_s, **{source: even_bw
                                                                        * 0.999}))
    assert faster.fetch_pages == num_pages
    assert slower.fetch_pages == 0


@settings(max_examples=200, deadline=None)
@given(sources=st.lists(st.sampled_from(SOURCES), max_size=12),
       num_tokens=st.integers(1, 300), wait_s=st.floats(0.0, 10.0),
       bandwidths=st.lists(st.floats(1e3, 1e10), min_size=4, max_size=4),
       latencies=st.lists(st.floats(0.0, 0.01), min_size=4, max_size=4),
       tokens_per_s=st.floats(1.0, 1e5), attention_s=st.sampled_from([0.0, 1e-9, 1e-6]))
def test_the_estimate_is_the_best_of_every_cut(sources, num_tokens, wait_s, bandwidths,
                                               latencies, tokens_per_s, attention_s):
    names = [DEVICE, HOST, DISK, REMOTE]
    rates = prior_rates({n: (b, lat) for n, b, lat in zip(names, bandwidths, latencies,
                                                          strict=True)}, tokens_per_s,
                        attention_s)
    prompt = Prompt(num_tokens, PAGE_TOKENS, PAGE_BYTES)
    candidate = Candidate("r", tuple(sources), wait_s)
    estimate = estimate_ttft(candidate, prompt, rates)
    assert estimate.ttft_s == pytest.approx(brute_force_s(candidate, prompt, rates))
    assert estimate.ttft_s == pytest.approx(estimate.queue_wait_s + estimate.fetch_s
                                            + estimate.prefill_s)
    assert 0 <= estimate.fetch_pages <= min(len(sources), (num_tokens - 1) // PAGE_TOKENS)


def test_the_engines_own_blocks_cost_nothing_and_one_token_is_always_prefilled():
    prompt = Prompt(4 * PAGE_TOKENS, PAGE_TOKENS, PAGE_BYTES)
    estimate = estimate_ttft(Candidate("a", (ENGINE,) * 4, 0.0), prompt, rates_with(100.0))
    assert estimate.fetch_pages == 3 and estimate.fetch_s == 0.0
    assert estimate.prefill_s == pytest.approx(PAGE_TOKENS / 100.0)


def test_prefill_prices_each_new_token_s_attention_over_the_tokens_before_it():
    prompt = Prompt(1000, PAGE_TOKENS, PAGE_BYTES)
    assert prefill_s(prompt, 0, 1_000.0, 1e-6) == pytest.approx(1.0 + 1e-6 * 1000 ** 2)
    # 10 pages cached: 840 tokens left, their pairs 1000^2 - 160^2
    assert prefill_s(prompt, 10, 1_000.0, 1e-6) == pytest.approx(0.84 + 1e-6 * (1e6 - 160**2))
    rates = prior_rates(prefill_tokens_per_s=1_000.0, attention_s_per_pair=1e-6)
    assert rates.prefill_s(prompt, 10, "any") == prefill_s(prompt, 10, 1_000.0, 1e-6)


def test_the_attention_term_makes_a_long_prompt_s_cached_head_worth_fetching():
    """A page costs 16 ms to recompute at 1,000 tokens/s and 20 ms to fetch: alone, the
    tokens say recompute. But recomputing a page also costs its tokens' attention over every
    token before them, which grows with the page's place: with the attention term, the whole
    cached head of 100 pages is worth its fetch."""
    prompt = Prompt(4000, PAGE_TOKENS, PAGE_BYTES)
    sources = (DISK,) * 100
    linear = rates_with(1_000.0, disk=PAGE_BYTES / 0.020)
    estimate = estimate_ttft(Candidate("a", sources, 0.0), prompt, linear)
    assert estimate.fetch_pages == 0
    quadratic = prior_rates({DISK: (PAGE_BYTES / 0.020, 0.0)}, 1_000.0, 1e-6)
    estimate = estimate_ttft(Candidate("a", sources, 0.0), prompt, quadratic)
    assert estimate.fetch_pages == 100
    assert estimate.prefill_s == pytest.approx(2400 / 1_000.0 + 1e-6 * (4000**2 - 1600**2))


def test_the_router_pools_the_replicas_attention_terms_by_their_samples():
    stats = {"a": {"prefill_tokens_per_s": 1000.0, "prefill_samples": 3,
                   "prefill_attention_s_per_pair": 1e-8},
             "b": {"prefill_tokens_per_s": 1000.0, "prefill_samples": 1,
                   "prefill_attention_s_per_pair": 5e-8},
             "c": {"prefill_tokens_per_s": 1000.0, "prefill_samples": 9}}  # none published
    rates = pooled(prior_rates(), stats)
    assert rates.attention_s_per_pair == pytest.approx((3 * 1e-8 + 5e-8) / 4)
    assert rates.as_dict()["attention_s_per_pair"] == rates.attention_s_per_pair
    assert pooled(prior_rates(), {"c": stats["c"]}).attention_s_per_pair == 0.0


# ---- the choice of replica ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(candidates=st.lists(st.tuples(st.lists(st.sampled_from(SOURCES), max_size=8),
                                     st.floats(0.0, 5.0), st.floats(50.0, 5000.0)),
                           min_size=1, max_size=6),
       num_tokens=st.integers(1, 200))
def test_the_replica_of_the_least_estimated_ttft_is_picked(candidates, num_tokens):
    rates = rates_with(1_000.0, disk=5e6, remote=5e7, host=1e9)
    for index, (_, _, tokens_per_s) in enumerate(candidates):
        rates = observe_prefill(rates, f"r{index}", 1000, 1000 / tokens_per_s)
    prompt = Prompt(num_tokens, PAGE_TOKENS, PAGE_BYTES)
    made = [Candidate(f"r{i}", tuple(s), w) for i, (s, w, _) in enumerate(candidates)]
    decision = decide(prompt, made, rates)
    times = [brute_force_s(c, prompt, rates) for c in made]
    chosen = [c.replica_id for c in made].index(decision.replica_id)
    assert times[chosen] == pytest.approx(min(times))
    assert decision.chosen.ttft_s == pytest.approx(min(times))
    assert decision.fetch_pages == decision.chosen.fetch_pages


@given(shared=st.lists(st.sampled_from(SOURCES), max_size=8), num_replicas=st.integers(1, 6),
       num_tokens=st.integers(1, 200))
def test_replicas_that_share_their_sources_get_the_estimate_each_would_alone(
        shared, num_replicas, num_tokens):
    """decide() computes a cut once per distinct (sources, prefill rate); each replica's
    estimate is still exactly estimate_ttft's for it."""
    rates = observe_prefill(rates_with(1_000.0, disk=5e6, remote=5e7, host=1e9), "r0", 500, 1.0)
    prompt = Prompt(num_tokens, PAGE_TOKENS, PAGE_BYTES)
    made = [Candidate(f"r{i}", tuple(shared), 0.1 * i) for i in range(num_replicas)]
    decision = decide(prompt, made, rates)
    assert list(decision.estimates) == [estimate_ttft(c, prompt, rates) for c in made]


def test_a_queue_outweighs_a_cached_prefix_when_it_is_longer_than_the_prefill_saved():
    prompt = Prompt(101 * PAGE_TOKENS, PAGE_TOKENS, PAGE_BYTES)
    rates = rates_with(1_000.0, host=1e10)
    cached = Candidate("cached", (HOST,) * 100, 1.0)
    idle = Candidate("idle", (), 0.0)
    assert decide(prompt, [cached, idle], rates).replica_id == "cached"  # saves 1.6 s > 1 s
    busier = Candidate("cached", (HOST,) * 100, 2.0)
    assert decide(prompt, [busier, idle], rates).replica_id == "idle"
    assert decide(prompt, [], rates) is None


def test_best_sources_take_the_engine_then_this_nodes_best_tier_then_another_node():
    located = [(("a", 2), ("a", 0), ("b", 0)), (("a", 1),), (("b", 2),), (("b", 0),)]
    sources = best_sources(located, ["a", "b", "c"])
    assert sources["a"] == (DEVICE, HOST, REMOTE, REMOTE)
    assert sources["b"] == (DEVICE, REMOTE, DISK, DEVICE)
    assert sources["c"] == (REMOTE,) * 4
    assert best_sources(located, ["a"], {"a": 2})["a"] == (ENGINE, ENGINE, REMOTE, REMOTE)
    assert best_sources([], ["a", "b"], {"a": 2}) == {"a": (ENGINE, ENGINE), "b": ()}
    # the engine's blocks past the directory's answer, and a node outside the candidates
    assert best_sources(located[:1], ["a"], {"a": 3, "z": 1}) == {"a": (ENGINE,) * 3}


# ---- rates measured online ----------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(prior_bw=st.floats(1e6, 1e11), true_bw=st.floats(1e6, 1e11),
       num_bytes=st.integers(1, 1 << 30), latency_s=st.floats(0.0, 0.001))
def test_a_paths_ewma_converges_to_what_transfers_take(prior_bw, true_bw, num_bytes,
                                                       latency_s):
    rates = prior_rates({HOST: (prior_bw, latency_s)})
    for _ in range(60):
        rates = observe_transfer(rates, HOST, num_bytes, latency_s + num_bytes / true_bw)
    assert rates.paths[HOST].bytes_per_s == pytest.approx(true_bw, rel=1e-6)
    assert rates.paths[HOST].num_samples == 60
    assert rates.paths[HOST].latency_s == latency_s


@settings(max_examples=100, deadline=None)
@given(true_bw=st.floats(1e6, 1e11), latency_s=st.floats(0.0, 0.05),
       sizes=st.lists(st.integers(1, 1 << 26), min_size=1, max_size=20))
def test_a_paths_measured_fixed_part_is_its_latency_whatever_the_sizes(true_bw, latency_s,
                                                                      sizes):
    """Transfers whose fixed part is measured apart (a vLLM load's time outside its reads):
    latency and rate are each what the transfers took, for any mix of sizes."""
    rates = prior_rates()
    for num_bytes in sizes * 3:
        rates = observe_transfer(rates, HOST, num_bytes, latency_s + num_bytes / true_bw,
                                 fixed_s=latency_s)
    assert rates.paths[HOST].latency_s == pytest.approx(latency_s, rel=1e-6, abs=1e-12)
    assert rates.paths[HOST].bytes_per_s == pytest.approx(true_bw, rel=1e-6)


def test_a_host_fetch_is_priced_by_its_latency_and_rate_not_a_small_loads_time_per_byte():
    """One-page host loads spending 10 ms outside their reads, a 22-page remote load 30 ms in
    all: a 23-page prefix on this node's host tier is a fetch of 13 ms, cheaper than the
    same pages from another node. With the fixed part taken as the bytes' (no `fixed_s`),
    the host path was priced at 10 ms a page, and routing preferred the remote copy."""
    page = 128 * 1024
    measured = prior_rates()
    for _ in range(3):
        measured = observe_transfer(measured, HOST, page, 0.010 + page / 1e9, fixed_s=0.010)
    measured = observe_transfer(measured, REMOTE, 22 * page, 0.030, fixed_s=0.006)
    prompt = Prompt(24 * 32 + 1, 32, page)
    on_host = estimate_ttft(Candidate("host", (HOST,) * 23, 0.0), prompt, measured)
    remote = estimate_ttft(Candidate("remote", (REMOTE,) * 23, 0.0), prompt, measured)
    assert on_host.fetch_pages == 23
    assert on_host.fetch_s == pytest.approx(0.010 + 23 * page / 1e9)
    assert on_host.ttft_s < remote.ttft_s
    unseparated = prior_rates()
    for _ in range(3):
        unseparated = observe_transfer(unseparated, HOST, page, 0.010 + page / 1e9)
    unseparated = observe_transfer(unseparated, REMOTE, 22 * page, 0.030)
    assert estimate_ttft(Candidate("host", (HOST,) * 23, 0.0), prompt, unseparated).ttft_s \
        > estimate_ttft(Candidate("remote", (REMOTE,) * 23, 0.0), prompt, unseparated).ttft_s


def test_the_ewma_follows_a_change_and_weighs_recent_samples_more():
    rates = observe_transfer(prior_rates(), DISK, 1000, 1.0)  # the first replaces the prior
    assert rates.paths[DISK].bytes_per_s == pytest.approx(1000.0)
    rates = observe_transfer(rates, DISK, 1000, 0.1)  # 10x faster now
    assert 1000.0 < rates.paths[DISK].bytes_per_s < 10_000.0
    for _ in range(100):
        rates = observe_transfer(rates, DISK, 1000, 0.1)
    assert rates.paths[DISK].bytes_per_s == pytest.approx(10_000.0, rel=1e-6)
    assert observe_transfer(rates, DISK, 0, 1.0) is rates  # nothing moved: nothing learnt


@settings(max_examples=100, deadline=None)
@given(tokens_per_s=st.floats(1.0, 1e6), num_tokens=st.integers(1, 100_000))
def test_prefill_rates_converge_per_replica_and_new_replicas_borrow_the_others(
        tokens_per_s, num_tokens):
    rates = prior_rates()
    for _ in range(40):
        rates = observe_prefill(rates, "a", num_tokens, num_tokens / tokens_per_s)
    assert rates.prefill_rate("a") == pytest.approx(tokens_per_s, rel=1e-6)
    assert rates.prefill_rate("new") == pytest.approx(tokens_per_s, rel=1e-6)
    assert prior_rates().prefill_rate("new") == prior_rates().prior_prefill_tokens_per_s


def test_merged_paths_weigh_each_replicas_measurement_by_its_samples():
    one = {HOST: PathRate(1e9, 0.004, 3)}
    two = {HOST: PathRate(4e9, 0.008, 1), DISK: PathRate(1e8, 0.0, 0)}
    merged = merge_paths(prior_rates(), [one, two])
    expected = 4 / (3 / 1e9 + 1 / 4e9)
    assert merged.paths[HOST].bytes_per_s == pytest.approx(expected)
    assert merged.paths[HOST].latency_s == pytest.approx((3 * 0.004 + 0.008) / 4)
    assert merged.paths[HOST].num_samples == 4
    assert merged.paths[DISK] == prior_rates().paths[DISK]  # nobody measured it
    shown = merged.as_dict()
    assert shown["paths"][HOST]["num_samples"] == 4
    assert math.isinf(shown["paths"][ENGINE]["bytes_per_s"])


def test_what_replicas_publish_pools_into_the_routers_estimates():
    one = observe_prefill(observe_transfer(prior_rates(), HOST, 1000, 1e-6), "a", 100, 0.1)
    two = observe_prefill(observe_transfer(prior_rates(), HOST, 1000, 3e-6), "b", 100, 0.2)
    two = observe_transfer(two, REMOTE, 1000, 1e-5)
    shown = {"a": published(one, "a"), "b": published(two, "b"), "c": {}}
    assert set(shown["a"]["paths"]) == {HOST}  # only what it measured
    rates = pooled(prior_rates(), shown)
    assert rates.paths[HOST].bytes_per_s == pytest.approx(2 / (1e-6 / 1000 + 3e-6 / 1000))
    assert rates.paths[REMOTE].bytes_per_s == pytest.approx(1e8)
    assert rates.paths[DISK] == prior_rates().paths[DISK]
    # The prefill rate is pooled over the replicas (one sample each): every replica, and one
    # that has published none, is estimated at it.
    for replica in ("a", "b", "c"):
        assert rates.prefill_rate(replica) == pytest.approx(2 / (1 / 1000 + 1 / 500))
    assert rates.as_dict()["prefill_default_tokens_per_s"] == pytest.approx(2000 / 3)


def test_pooled_prefill_rates_weigh_samples_and_keep_the_prior_without_any():
    shown = {"a": {"prefill_tokens_per_s": 1000.0, "prefill_samples": 3},
             "b": {"prefill_tokens_per_s": 4000.0, "prefill_samples": 1}, "c": {}}
    rates = pooled(prior_rates(), shown)
    assert rates.prefill_rate("b") == pytest.approx(4 / (3 / 1000 + 1 / 4000))
    assert pooled(prior_rates(), {"a": {}}).prefill_rate("a") == PRIOR_PREFILL_TOKENS_PER_S


def test_a_replica_measured_slower_on_a_few_noisy_steps_is_not_starved():
    """Identical replicas; one published a rate 7x below the other's (an EWMA over a few
    steps of a shared machine). The request goes where its prefix is held, not to the
    replica whose own figure happened to be higher."""
    shown = {"fast": {"prefill_tokens_per_s": 7000.0, "prefill_samples": 5},
             "slow": {"prefill_tokens_per_s": 1000.0, "prefill_samples": 5}}
    rates = pooled(prior_rates(), shown)
    prompt = Prompt(3200, 32, 1 << 17)
    decision = decide(prompt, [Candidate("fast", (), 0.0),
                               Candidate("slow", (HOST,) * 50, 0.0)], rates)
    assert decision.replica_id == "slow" and decision.fetch_pages == 50
