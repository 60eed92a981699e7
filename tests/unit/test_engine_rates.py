"""A vLLM engine's own measurements for cost-based routing (cluster/serving/engine_rates.py):
a load's samples per source tier, the prefill rate fitted to timed steps, the step clock, the
meter's published rates and the file that carries them to the Serve replica; and raykv's
router deciding on them: it recomputes a prefix whose measured fetch is slower than its
prefill, and fetches it otherwise."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from cluster.serving import engine_rates
from cluster.serving.engine_rates import (
    CUT_BOUND_FACTOR,
    EngineMeter,
    PrefillFit,
    RatesFile,
    Step,
    StepClock,
    load_samples,
    rates_path,
    read_published,
    remove_published,
    write_published,
)
from cluster.serving.step_budget import StepBudget
from policies.cost_routing import DISK, HOST, PRIOR_PATHS, REMOTE, pooled, prior_rates
from tests.unit.test_engine_routing import KEYS, PAGE, PROMPT, Follower, make_router
from tests.unit.test_routing import AsyncFakeDirectory, pending_tokens

MiB = 1 << 20


def test_a_host_load_gets_its_copy_and_the_rest_of_the_load_s_time_as_its_fixed_part():
    samples = load_samples([(HOST, 4 * MiB, 0.002)], 0.010)
    assert samples == [(HOST, 4 * MiB, pytest.approx(0.010), pytest.approx(0.008))]


def test_the_meter_tells_a_load_s_fixed_part_from_its_bytes():
    """Loads of 1 and of 23 pages that each spend 10 ms outside their reads (the directory,
    the hand-off) and read at 1 GB/s: the host path's latency is the 10 ms, its rate the
    reads'; a 23-page fetch is priced at what it takes (12.9 ms), not at 23 times a one-page
    load's time per byte (the estimate before the fixed part was measured apart)."""
    page = 128 * 1024
    meter = EngineMeter(32, page)
    for num_pages in (1, 1, 23, 1, 23, 1):
        read_s = num_pages * page / 1e9
        meter.loaded(load_samples([(HOST, num_pages * page, read_s)], read_s + 0.010))
    host = meter.rates.paths[HOST]
    assert host.latency_s == pytest.approx(0.010)
    assert host.bytes_per_s == pytest.approx(1e9)
    assert host.seconds(23 * page) == pytest.approx(0.010 + 23 * page / 1e9)
    # A sample without its fixed part (a worker of an earlier release) keeps the latency.
    meter.loaded([(HOST, page, 0.010 + page / 1e9)])
    assert meter.rates.paths[HOST].latency_s == pytest.approx(0.010)
    assert meter.rates.paths[HOST].bytes_per_s == pytest.approx(1e9)


def test_pages_read_up_from_disk_count_their_copy_out_of_host_as_disk_time():
    # 8 pages from disk (acquire 40 ms), then the whole 12 pages copied out of host (3 ms):
    # 4 pages were in host already; 5 ms of the load was neither (directory, scatter).
    page = MiB
    samples = dict((s, (b, t)) for s, b, t, _ in load_samples(
        [(DISK, 8 * page, 0.040), (HOST, 12 * page, 0.003)], 0.048))
    assert samples[DISK][0] == 8 * page and samples[HOST][0] == 4 * page
    assert samples[DISK][1] == pytest.approx(0.040 + 0.002 + 0.005 * 8 / 12)
    assert samples[HOST][1] == pytest.approx(0.001 + 0.005 * 4 / 12)
    assert sum(t for _, t in samples.values()) == pytest.approx(0.048)


def test_a_load_that_read_nothing_teaches_nothing():
    assert load_samples([], 0.5) == []
    assert load_samples([(REMOTE, 0, 0.1)], 0.5) == []


def test_the_prefill_rate_is_the_marginal_rate_not_a_short_prefill_s_step_overhead():
    # Steps take 12 ms plus 0.1 ms a token (10,000 tokens/s): a 9-token prefill's step
    # (12.9 ms) read as one rate would say 700 tokens/s.
    fit = PrefillFit()
    for num_tokens in (1285, 9, 1285, 9, 256, 9, 1536):
        fit.add(num_tokens, 0.012 + 1e-4 * num_tokens)
    assert 1 / fit.per_token_s() == pytest.approx(10_000, rel=1e-6)
    assert fit.fixed_s() == pytest.approx(0.012, rel=1e-6)


def test_steps_of_one_size_give_their_mean_rate():
    fit = PrefillFit()
    assert fit.per_token_s() is None and fit.fixed_s() == 0.0
    for _ in range(3):
        fit.add(500, 0.05)
    assert fit.per_token_s() == pytest.approx(1e-4) and fit.fixed_s() == pytest.approx(0.0)


def test_the_fit_follows_an_engine_that_slows_down():
    fit = PrefillFit()
    for num_tokens in (1000, 10) * 5:
        fit.add(num_tokens, 0.01 + 1e-4 * num_tokens)
    for num_tokens in (1000, 10) * 15:  # now twice as slow a token
        fit.add(num_tokens, 0.01 + 2e-4 * num_tokens)
    assert fit.per_token_s() == pytest.approx(2e-4, rel=0.02)


def test_a_step_starts_no_earlier_than_the_previous_one_ended():
    clock = StepClock()
    assert clock.done(1.0) is None
    clock.scheduled(Step(100, True, 10.0))
    clock.scheduled(Step(5, False, 10.1))  # async scheduling: handed out while one runs
    first, first_s = clock.done(10.5)
    second, second_s = clock.done(10.6)
    assert (first.num_tokens, first_s) == (100, pytest.approx(0.5))
    assert (second.num_tokens, second_s) == (5, pytest.approx(0.1))
    clock.scheduled(Step(7, True, 20.0))  # idle in between: from its own hand-out
    assert clock.done(20.2)[1] == pytest.approx(0.2)


def meter_with(disk_s_per_page: float, page_bytes: int = 2048) -> EngineMeter:
    """A meter as the scheduler side fills it: prefill steps of 10,000 tokens/s (+ 5 ms),
    loads of 4 pages from disk at `disk_s_per_page`, requests finished one by one."""
    meter = EngineMeter(PAGE, page_bytes)
    now_s = 0.0
    for num_tokens in (68, 4, 68, 4):
        meter.clock.scheduled(Step(num_tokens, True, now_s))
        now_s += 0.005 + num_tokens / 10_000
        meter.step_done(now_s)
        meter.finished()
        meter.loaded([(DISK, 4 * page_bytes, 4 * disk_s_per_page)])
    return meter


def test_the_meter_publishes_what_raykv_s_engines_publish():
    meter = meter_with(disk_s_per_page=0.02)
    published = meter.published()
    assert published["prefill_tokens_per_s"] == pytest.approx(10_000, rel=1e-6)
    assert published["step_overhead_s"] == pytest.approx(0.005, rel=1e-6)
    assert published["prefill_samples"] == 4
    assert published["page_tokens"] == PAGE and published["page_bytes"] == 2048
    bytes_per_s, latency_s, count = published["paths"][DISK]
    assert bytes_per_s == pytest.approx(2048 / 0.02) and (latency_s, count) == (0.0, 4)
    assert set(published["paths"]) == {DISK}  # only what was measured
    # Requests of 11.8 and 5.4 ms, alternating, in an EWMA of weight 0.2 from the first.
    busy_s = 0.0118
    for sample_s in (0.0054, 0.0118, 0.0054):
        busy_s += 0.2 * (sample_s - busy_s)
    assert published["busy_s_per_request"] == pytest.approx(busy_s)
    # The router pools it as it pools raykv's own engines' figures.
    rates = pooled(prior_rates(), {"r0": published})
    assert rates.prefill_rate("r0") == pytest.approx(10_000, rel=1e-6)
    assert rates.paths[DISK].bytes_per_s == pytest.approx(2048 / 0.02)


def test_a_load_in_the_step_is_estimated_from_those_made_in_the_step_and_steps_report_time():
    meter = EngineMeter(PAGE, 2048)
    host_bytes_per_s = PRIOR_PATHS[HOST][0]
    assert meter.load_s(4 * PAGE) == pytest.approx(4 * 2048 / host_bytes_per_s)  # the prior
    meter.loaded([(HOST, 4 * 2048, 0.2)])  # a background load, slowed by the engine's thread
    assert meter.load_s(4 * PAGE) == pytest.approx(4 * 2048 / host_bytes_per_s)  # no guide
    meter.loaded_in_step([(4 * 2048, 0.002, False)])
    assert meter.load_s(4 * PAGE) == pytest.approx(0.002)
    assert meter.load_s(PAGE + 1) == pytest.approx(0.001)  # whole pages
    assert meter.load_s(0) == 0.0
    # 2 ms a page now; nothing from 0 bytes
    meter.loaded_in_step([(2 * 2048, 0.004, False), (0, 1.0, False)])
    assert meter.load_s(PAGE) == pytest.approx(0.8 * 0.0005 + 0.2 * 0.002)
    assert meter.in_step.num_samples == 2
    assert meter.recompute_s(100) == 0.0  # no prefill timed yet
    meter.clock.scheduled(Step(100, True, 3.0))
    meter.step_done(3.05)
    assert meter.recompute_s(100) == pytest.approx(0.05)
    meter.clock.scheduled(Step(0, False, 0.0))
    assert meter.step_done(0.001) is None  # an empty step is not timed
    meter.clock.scheduled(Step(3, False, 1.0))
    assert meter.step_done(1.02) == pytest.approx(0.02)
    assert meter.step_done(2.0) is None  # none pending


def test_a_load_cut_at_its_deadline_raises_the_estimate_to_at_least_twice_its_time():
    """A cut is a bound, not a sample: blended into the EWMA of fast loads (20 ms a page
    here), a 0.2 s cut would leave the next estimate at 0.09 s, under the deadline, and the
    next load of that size would be tried in the step and cut again. At the cut's time
    alone, a deadline a little later (it follows the prefill rate) let the next one in."""
    meter = EngineMeter(PAGE, 2048)
    for _ in range(10):
        meter.loaded_in_step([(10 * 2048, 0.02, False)])
    meter.loaded_in_step([(10 * 2048, 0.2, True)])
    assert meter.load_s(10 * PAGE) == pytest.approx(CUT_BOUND_FACTOR * 0.2)
    budget = StepBudget(num_steps=1, remaining_s=1.0)  # it would wait for anything under 1 s
    assert not budget.may_load_in_step(meter.load_s(10 * PAGE), 0.21)  # a later deadline
    meter.loaded_in_step([(10 * 2048, 0.1, True)])  # a lower bound never lowers it
    assert meter.load_s(10 * PAGE) == pytest.approx(CUT_BOUND_FACTOR * 0.2)
    meter.loaded_in_step([(10 * 2048, 0.02, False)])  # loads that land bring it back down
    assert meter.load_s(10 * PAGE) == pytest.approx(0.8 * 0.4 + 0.2 * 0.02)


def test_busy_seconds_per_request_share_the_steps_between_finishes():
    meter = EngineMeter(PAGE, 2048)
    for index in range(4):  # two requests batched: 4 steps of 10 ms, both finish at the end
        meter.clock.scheduled(Step(2, index == 0, float(index)))
        meter.step_done(index + 0.01)
    meter.finished()
    meter.finished()
    assert meter.busy_s_per_request == pytest.approx(0.04 * 0.8)  # 40 ms, then 0 (EWMA)


def test_the_rates_file_round_trips_and_reads_empty_before_it_is_written(tmp_path):
    path = str(tmp_path / "engine-rates" / "e1.json")
    assert read_published(path) == {}
    write_published(path, meter_with(0.02).published())
    assert read_published(path)["page_tokens"] == PAGE
    assert rates_path("abc").endswith("abc.json")
    remove_published(path)
    assert read_published(path) == {} and not os.path.exists(path)
    remove_published(path)  # already gone: fine


def test_the_rates_file_is_written_at_most_once_a_period_and_after_the_last_change(
        tmp_path):
    path = str(tmp_path / "rates.json")
    meter = EngineMeter(PAGE, 2048)
    rates = RatesFile(meter, path, period_s=0.3)
    rates.changed()  # the first change: written at once
    assert read_published(path)["busy_s_per_request"] == 0.0
    meter.busy_s_per_request = 0.5  # a change within the period: put off, not lost
    rates.changed()
    rates.changed()
    assert read_published(path)["busy_s_per_request"] == 0.0
    time.sleep(0.6)
    assert read_published(path)["busy_s_per_request"] == 0.5
    rates.close()


def decide_on_disk_prompt(rates: dict | None):
    """The router's decision for one replica (r0 on node-0) whose node holds the prompt's 4
    pages on its disk tier, publishing `rates` as RaykvLLMServer does (None: no rates, as
    vLLM replicas did before); returns the router."""
    async def main():
        directory = AsyncFakeDirectory()
        directory.place("node-0", KEYS, 2)  # the disk tier
        router, replicas = make_router(directory, Follower(), advertise=())
        replicas = replicas[:1]
        router.update_replicas(replicas)
        if rates is not None:
            replicas[0].routing_stats["rates"] = rates
        await router.choose_replicas(replicas, pending_tokens([bytes(k) for k in KEYS],
                                                              len(PROMPT)))
        return router

    return asyncio.run(main())


@pytest.mark.parametrize("disk_s_per_page, recompute", [(0.02, True), (1e-5, False)])
def test_the_router_recomputes_when_the_measured_fetch_is_slower(tmp_path, disk_s_per_page,
                                                                 recompute):
    """A vLLM replica's measured rates, through the file its server reads: 4 pages from disk
    at 20 ms each cost 80 ms, their prefill 6.4 ms: recompute; at 10 us a page, fetch."""
    path = str(tmp_path / "rates.json")
    write_published(path, meter_with(disk_s_per_page).published())
    router = decide_on_disk_prompt(read_published(path))
    decision = router.last_decision
    assert decision is not None and decision.num_cached_pages == 4
    assert decision.recompute is recompute
    assert decision.fetch_pages == (0 if recompute else 4)
    assert router.counters["recomputed"] == int(recompute)


def test_without_measured_rates_the_router_fetches_a_slow_disk_s_pages():
    """What the slowed disk got before vLLM replicas published rates: no cost decision at
    all (the replica publishes no page size), so the whole prefix is fetched."""
    router = decide_on_disk_prompt(None)
    assert router.last_decision is None and router.counters["recomputed"] == 0


def test_the_rates_files_read_are_those_written_since_a_time(tmp_path, monkeypatch):
    """A bench set-up's engines' rates files (one per RaykvConnector engine) are those
    written after it began; an earlier set-up's files are left out."""
    monkeypatch.setattr(engine_rates, "rates_path", lambda engine_id: str(tmp_path / "rates" /
                                                                          f"{engine_id}.json"))
    assert engine_rates.rates_files_since(0.0) == []  # no directory yet
    engine_rates.write_published(engine_rates.rates_path("old"), {"lookups_skipped": 1})
    began_s = time.time()
    os.utime(engine_rates.rates_path("old"), (began_s - 60, began_s - 60))
    for name in ("a", "b"):
        engine_rates.write_published(engine_rates.rates_path(name), {"lookups_skipped": 2})
    found = engine_rates.rates_files_since(began_s)
    assert [os.path.basename(p) for p in found] == ["a.json", "b.json"]
    assert [engine_rates.read_published(p)["lookups_skipped"] for p in found] == [2, 2]
