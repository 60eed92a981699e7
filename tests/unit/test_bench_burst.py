"""`raykv bench burst` and `raykv bench elastic`: their pure pieces (the per-second timeline,
the rounds' pairing and when a ratio is not exercised, the static split, the quota floor).
No Ray: the replays are stand-ins."""

from __future__ import annotations

import pytest

from cluster.core.config import MiB
from cluster.tools.bench import burst, burst_plot, elastic, harness
from cluster.tools.replay import Outcome


def outcome(request_id: int, arrival_s: float, fetch_ms: float, cached: int,
            spike: bool = False) -> Outcome:
    return Outcome(request_id, 0, "tiny-llama", spike, arrival_s, arrival_s, fetch_ms / 1e3,
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
    assert elastic.GOALS == {"elastic_vs_static_hit_ratio": {"min": 1.1},
                             "min_quota_violations": {"max": 0}}
    assert burst_plot.event_counts([{"kind": "copy"}, {"kind": "copy"}, {"kind": "drop"}]) == \
        {"copy": 2, "drop": 1}


def fake_replays(monkeypatch, p99_ms: dict[str, list[float]], on_copies: list[int]) -> list:
    """burst.replay_once replaced: round i's run of a mode has 100 requests, one of them
    p99_ms[mode][i] slow, and (on) on_copies[i] copies; returns the calls' modes."""
    calls: list[str] = []

    def replay_once(trace, node_ids, rebalance):
        mode = "on" if rebalance else "off"
        index = sum(1 for m in calls if m == mode)
        calls.append(mode)
        slow = p99_ms[mode][index]
        outcomes = [outcome(i, i * 0.1, slow if i == 0 else 1.0, 90 if rebalance else 100,
                            spike=i % 2 == 0) for i in range(100)]
        control = {"copies": on_copies[index], "moves": 0} if rebalance else {}
        return burst.Run(outcomes, [], control)

    monkeypatch.setattr(burst, "replay_once", replay_once)
    return calls


def new_report() -> harness.Report:
    return harness.Report("burst", "ms", {}, burst.GOALS)


def test_rebalance_pairs_rounds_rotating_and_takes_each_rounds_own_p99(monkeypatch):
    calls = fake_replays(monkeypatch, {"off": [400.0, 300.0, 900.0], "on": [100.0, 200.0,
                                                                              100.0]}, [3, 1, 2])
    report = new_report()
    part = burst.run_rebalance(["a", "b", "c"], quick=True, report=report)
    assert calls == ["off", "on", "on", "off", "off", "on"]
    off = [r["off"]["fetch_p99_ms"] for r in part["rounds"]]
    on = [r["on"]["fetch_p99_ms"] for r in part["rounds"]]
    per_round = [o / n for o, n in zip(off, on, strict=True)]
    assert report.ratios["p99_improvement"] == pytest.approx(sorted(per_round)[1])
    assert report["spread"]["p99_improvement"]["rounds"] == pytest.approx(per_round)
    assert report.ratios["hit_ratio_delta"] == pytest.approx(-0.1)
    assert [r["on"]["actions"] for r in part["rounds"]] == [3, 1, 2]
    assert not report["not_exercised"]


def test_rebalance_is_not_exercised_when_an_on_round_did_nothing(monkeypatch):
    fake_replays(monkeypatch, {"off": [400.0] * 3, "on": [100.0] * 3}, [3, 0, 2])
    report = new_report()
    burst.run_rebalance(["a", "b", "c"], quick=True, report=report)
    assert report.ratios == {"p99_improvement": None, "hit_ratio_delta": None}
    assert set(harness.failed(report.result)) == {"p99_improvement", "hit_ratio_delta"}
    assert not burst.exercised(0, [{"on": {"actions": 5}}] * 3)  # no burst in the trace


def test_static_split_is_in_proportion_to_working_sets_in_whole_chunks():
    sets = elastic.working_set_bytes()
    assert sets == {"small": 6 * MiB, "medium": 32 * MiB, "large": 40 * MiB}
    # 12 chunks of 4 MiB: exact shares 0.92, 4.92, 6.15 -> at least 1 each, then the chunk
    # left to the one furthest under its share: 1, 5, 6
    assert elastic.static_quotas() == {"small": 4 * MiB, "medium": 20 * MiB, "large": 24 * MiB}
    # never past what a model wants, rounded up to a chunk; the rest to the others
    split = elastic.proportional_split({"a": 1, "b": 100}, budget_bytes=48, chunk_bytes=4)
    assert split == {"a": 4, "b": 44}
    assert elastic.proportional_split({"a": 1, "b": 3}, 40, 4) == {"a": 4, "b": 4}


@pytest.mark.parametrize("samples, violations, reached", [
    ([0, 16, 28, 28, 28], 0, True),  # filled to the floor; the pressure left it there
    ([0, 16, 32, 32, 28], 0, True),  # filled past the floor, pushed back to it
    ([0, 16, 32, 24, 28], 1, True),  # pushed under it once
    ([0, 16, 24, 24, 24], 0, False),  # never reached the floor
    ([0, 16, 32, 32, 32], 0, False),  # the pressure never brought it down to the floor
    ([28, 16, 32, 32, 32], 1, False),  # a dip before the pressure counts, but nothing pressed
])
def test_quota_floor_counts_violations_and_whether_it_was_reached(samples, violations,
                                                                  reached):
    # samples 0-2: the model fills; 3-4: another model presses
    assert elastic.floor_outcome(samples, 3, 28) == {"min_quota_violations": violations,
                                                     "reached": reached}
