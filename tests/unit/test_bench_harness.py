"""The benchmark harness: rotation, pairing, spread, ratios that can fail, the JSON."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.tools.bench import harness


def test_every_round_runs_every_contender_once_in_rotating_order():
    calls = []
    figures = harness.interleave({name: (lambda r, n=name: calls.append((r, n)) or r + 1.0)
                                  for name in ("a", "b", "c")}, 3)
    assert figures == {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0, 3.0], "c": [1.0, 2.0, 3.0]}
    assert [n for _, n in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_fewer_than_three_rounds_are_refused():
    with pytest.raises(harness.NotEnoughRounds):
        harness.interleave({"a": lambda r: 1.0}, 2)
    with pytest.raises(harness.NotEnoughRounds):
        harness.Report("x", "s", {}, {}).paired("r", [1.0, 2.0], [1.0, 1.0])


@settings(deadline=None)  # pure and fast; a loaded machine must not fail it
@given(st.lists(st.text(min_size=1), min_size=1, max_size=6, unique=True),
       st.integers(0, 50))
def test_a_rotation_is_a_permutation_and_each_name_leads_once_per_cycle(names, index):
    assert sorted(harness.rotation(names, index)) == sorted(names)
    leaders = {harness.rotation(names, index + k)[0] for k in range(len(names))}
    assert leaders == set(names)


def test_paired_is_the_median_of_round_ratios_with_its_spread():
    report = harness.Report("x", "GB/s", {}, {"r": {"min": 0.9}})
    value = report.paired("r", [2.0, 9.0, 3.0], [2.0, 3.0, 4.0])
    assert value == 1.0  # rounds 1.0, 3.0, 0.75
    assert report["spread"]["r"] == {"min": 0.75, "max": 3.0, "rounds": [1.0, 3.0, 0.75]}


def test_a_ratio_nothing_exercised_is_null_unmet_and_fails_the_run(tmp_path):
    report = harness.Report("x", "s", {}, {"evicted": {"min": 1.1}, "ok": {"max": 2.0}})
    assert report.require("evicted", False, "no page was evicted") is False
    report.ratio("ok", 1.0)
    path = tmp_path / "r.json"
    result = report.finish(str(path))
    assert result["met"] == {"evicted": False, "ok": True}
    assert harness.failed(result) == {"evicted": "no page was evicted"}
    written = json.loads(path.read_text())
    assert written["ratios"]["evicted"] is None and written["machine"]["loadavg_end"]


def test_goals_met_treats_nan_and_missing_as_unmet():
    goals = {"a": {"min": 1.0}, "b": {"max": 1.0}, "c": {"min": 0.0}}
    assert harness.goals_met({"a": float("nan"), "b": 0.5}, goals) == {
        "a": False, "b": True, "c": False}


def test_a_result_that_cannot_be_written_leaves_the_previous_file_whole(tmp_path):
    # found by an audit: open("w") then json.dump(allow_nan=False) truncated the last good
    # result and left half a JSON object when a figure was NaN
    path = tmp_path / "r.json"
    path.write_text('{"previous": "good"}')
    report = harness.Report("x", "s", {}, {})
    report.ratio("a", 1.0)
    report["figures"] = {"p99": float("nan")}
    with pytest.raises(ValueError, match="JSON"):
        report.finish(str(path))
    assert path.read_text() == '{"previous": "good"}'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
    report["figures"] = {"p99": 2.0}
    report.finish(str(path))
    assert json.loads(path.read_text())["figures"] == {"p99": 2.0}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_an_atomic_write_that_fails_at_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    from cluster.tools import outputs

    path = tmp_path / "r.json"
    path.write_text("old")

    def refuse(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(outputs.os, "replace", refuse)
    with pytest.raises(OSError, match="disk gone"):
        outputs.write_text_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
