"""The benchmarks' shared helpers: statistics, goals, the JSON result. No Ray."""

import json

import pytest

from cluster.tools.bench import common


def test_goals_met_checks_both_bounds():
    goals = {"low": {"max": 30.0}, "high": {"min": 0.6}}
    assert common.goals_met({"low": 29.0, "high": 0.7}, goals) == {"low": True, "high": True}
    assert common.goals_met({"low": 31.0, "high": 0.5}, goals) == {"low": False, "high": False}
    assert common.goals_met({"low": 30.0, "high": 0.6}, goals) == {"low": True, "high": True}


def test_goal_text():
    assert common.goal_text({"min": 0.6}) == ">= 0.6"
    assert common.goal_text({"max": 1.5}) == "<= 1.5"
    assert common.goal_text(None) == ""


def test_percentiles_and_latency_in_ms():
    times_s = [0.001 * i for i in range(1, 101)]
    assert common.percentile_ms(times_s, 50) == pytest.approx(50.5)
    figures = common.latency_ms(times_s)
    assert figures["p50_ms"] == pytest.approx(50.5)
    assert figures["p99_ms"] == pytest.approx(99.01)
    assert figures["mean_ms"] == pytest.approx(50.5)


def test_median_ratio_pairs_rounds_and_geomean():
    assert common.median_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0
    assert common.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert common.medians({"a": [3.0, 1.0, 2.0]}) == {"a": 2.0}


def test_median_s_times_each_call_and_warm_median_s_adds_one_call():
    calls = []
    assert common.median_s(lambda: calls.append(1), 3) >= 0
    assert len(calls) == 3
    common.warm_median_s(lambda: calls.append(1), 3)
    assert len(calls) == 7


def test_finish_adds_met_and_load_and_writes_json(tmp_path):
    result = {"benchmark": "t", "machine": common.machine_info(), "ratios": {"r": 2.0},
              "goals": {"r": {"min": 1.0}}}
    json_path = tmp_path / "t.json"
    assert common.finish(result, str(json_path)) is result
    assert result["met"] == {"r": True}
    assert len(result["machine"]["loadavg_end"]) == 3
    assert json.loads(json_path.read_text()) == result
    assert result["machine"]["nproc"] >= 1


def test_page_kv_holds_the_page_pool_page_by_page_and_check_same():
    import torch

    from cluster.core.kvcheck import page_slices
    from cluster.core.spec import ModelSpec
    from cluster.tools.bench import peers

    spec = ModelSpec("t", 2, 2, 8, "bfloat16")
    page_tokens, num_pages = 4, 3
    kv = common.page_kv(spec, page_tokens, num_pages)
    assert tuple(kv.shape) == spec.page_shape(page_tokens * num_pages)
    pool = peers.page_pool(spec.page_bytes(page_tokens), num_pages)
    for page in range(num_pages):
        got = kv[:, :, :, page_slices(page, page_tokens)].contiguous().view(torch.uint8)
        assert got.flatten().numpy().tobytes() == pool[page].tobytes()
    out = common.touched_like(kv)
    with pytest.raises(RuntimeError, match="different bytes"):
        common.check_same(out, kv, "kv")
    out.copy_(kv)
    common.check_same(out, kv, "kv")
