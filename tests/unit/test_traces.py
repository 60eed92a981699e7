"""Spiky traces: the generator and the Parquet round trip. No Ray."""

from __future__ import annotations

import collections

import pytest

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
