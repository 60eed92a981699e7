"""Spiky traces (generator, Parquet round trip), and `raykv bench burst`'s pure pieces: the
per-second timeline, the merged ratios of its parts. No Ray."""

from __future__ import annotations

import collections

import pytest

from cluster.tools.bench import burst, burst_plot, elastic
from cluster.tools.replay import Outcome
from cluster.tools.traces import (
    TraceShape,
    load_trace,
    make_trace,
    prompt_tokens,
    save_trace,
    spike_factor_at,
    spike_index,
)

SHAPE = TraceShape(duration_s=40.0, base_rate_per_s=20.0, first_spike_s=10.0,
                   spike_every_s=20.0, spike_s=6.0, ramp_s=2.0, num_prefixes=50,
                   models=("small-llama", "tiny-llama"), tenants=("default", "acme"),
                   node_capacity_per_s=40.0, seed=1)


def test_spike_windows_and_ramp():
    assert spike_index(SHAPE, 9.9) is None and spike_index(SHAPE, 10.0) == 0
    assert spike_index(SHAPE, 15.9) == 0 and spike_index(SHAPE, 16.0) is None
    assert spike_index(SHAPE, 31.0) == 1
    assert spike_factor_at(SHAPE, 5.0) == 1.0
    assert spike_factor_at(SHAPE, 11.0) == pytest.approx(5.5)  # half-way up the ramp
    assert spike_factor_at(SHAPE, 13.0) == 10.0


def test_poisson_rate_is_ten_times_higher_in_spikes():
    trace = make_trace(SHAPE)
    quiet = sum(1 for r in trace if r.arrival_s < 10.0) / 10.0
    peak = sum(1 for r in trace if 12.0 <= r.arrival_s < 16.0) / 4.0
    assert quiet == pytest.approx(20.0, rel=0.3)
    assert peak == pytest.approx(200.0, rel=0.2)
    assert [r.request_id for r in trace] == list(range(len(trace)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:], strict=False))


def test_zipf_prefixes_models_tenants_and_spike_prefixes():
    trace = make_trace(SHAPE)
    base = collections.Counter(r.prefix_id for r in trace if not r.spike)
    assert base.most_common(1)[0][0] in (0, 1) and base[0] > 5 * base.get(40, 1)
    spiked = {r.prefix_id for r in trace if r.spike}
    assert len(spiked) <= 2 * SHAPE.num_spike_prefixes and max(spiked) < SHAPE.spike_ranks
    assert {r.model for r in trace} == set(SHAPE.models)
    assert {r.tenant for r in trace} == set(SHAPE.tenants)
    assert all(r.prefix_tokens % SHAPE.page_tokens == 0 for r in trace)
    assert {r.priority for r in trace} == {"high", "normal"}


def test_home_node_unless_it_is_over_capacity():
    trace = make_trace(SHAPE)
    quiet = [r for r in trace if not r.spike and r.arrival_s < 10.0]
    assert all(r.node == r.prefix_id % SHAPE.num_nodes for r in quiet)
    spilled = [r for r in trace if r.spike and r.node != r.prefix_id % SHAPE.num_nodes]
    assert spilled, "a spike past one node's capacity overflows to the others"
    per_node = collections.Counter(r.node for r in trace if 13.0 <= r.arrival_s < 16.0)
    assert min(per_node.values()) > 0.2 * max(per_node.values())


def test_same_shape_same_trace_and_parquet_round_trip(tmp_path):
    trace = make_trace(SHAPE)
    assert make_trace(SHAPE) == trace
    path = str(tmp_path / "trace.parquet")
    save_trace(trace, path)
    assert load_trace(path) == trace


def test_prompt_tokens_share_the_prefix_and_differ_after_it():
    a, b = [r for r in make_trace(SHAPE) if r.prefix_id == 0][:2]
    ta, tb = prompt_tokens(a), prompt_tokens(b)
    assert len(ta) == a.prefix_tokens + a.suffix_tokens
    assert ta[: a.prefix_tokens] == tb[: b.prefix_tokens]
    assert ta[a.prefix_tokens:] != tb[b.prefix_tokens:]


# ---- the benchmark's pure pieces --------------------------------------------------------------


def outcome(request_id: int, arrival_s: float, fetch_ms: float, cached: int) -> Outcome:
    return Outcome(request_id, 0, "tiny-llama", False, arrival_s, arrival_s, fetch_ms / 1e3,
                   100, cached)


def test_timeline_bins_rate_hits_p99_and_memory():
    outcomes = [outcome(0, 0.2, 5.0, 100), outcome(1, 0.7, 50.0, 0), outcome(2, 2.5, 7.0, 50)]
    tiers = {"bytes": {"device": 1, "host": 2, "disk": 4}}
    samples = [(0.5, "a", tiers), (0.9, "a", {"bytes": {"device": 10, "host": 20, "disk": 0}}),
               (0.5, "b", tiers), (2.1, "b", {"bytes": {"device": 0, "host": 0, "disk": 9}})]
    line = burst_plot.timeline(outcomes, samples, duration_s=3.0)
    assert line["time_s"] == [0.0, 1.0, 2.0] and line["rate_per_s"] == [2.0, 0.0, 1.0]
    assert line["hit_ratio"] == [0.5, None, 0.5]
    assert line["fetch_p99_ms"][0] == pytest.approx(49.55) and line["fetch_p99_ms"][1] is None
    assert line["memory_source"] == "tiers"
    # a's last sample of bin 0 holds on (no sample since); b's changes in bin 2
    assert line["memory_bytes"] == {"all models, device+host": [33.0, 33.0, 30.0],
                                    "all models, disk": [4.0, 4.0, 9.0]}
    models = [(0.5, "a", {"models": {"m1": 7}, "bytes": {}}), (0.5, "b", {"models": {"m1": 1}})]
    line = burst_plot.timeline([], models, duration_s=1.0)
    assert line["memory_source"] == "models" and line["memory_bytes"] == {"m1": [8.0]}


def test_parts_registry_and_goals():
    assert set(burst.PARTS) == {"rebalance", "elastic"}
    assert burst.GOALS == {"p99_improvement": {"min": 2.0}, "hit_ratio_delta": {"min": -0.02}}
    assert elastic.GOALS == {"elastic_vs_static_hit_ratio": {"min": 1.2},
                             "min_quota_violations": {"max": 0}}
    assert burst_plot.event_counts([{"kind": "copy"}, {"kind": "copy"}, {"kind": "drop"}]) == \
        {"copy": 2, "drop": 1}
