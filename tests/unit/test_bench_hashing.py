"""`raykv bench hashing` on a tiny prompt: the output's shape, the rounds, the key check. No Ray."""

import json
import math

from cluster.tools.bench import harness, hashing


def test_run_writes_ratios_goals_rounds_and_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "QUICK_TOKENS", 2048)
    monkeypatch.setattr(hashing, "CALLS_PER_ROUND", 1)
    json_path = tmp_path / "hashing.json"

    result = hashing.run(str(json_path), quick=True)

    assert json.loads(json_path.read_text()) == result
    assert set(result["ratios"]) == {"hash_ns_per_token", "hash_ns_per_token_numpy",
                                     "hash_ns_per_token_pt16", "hash_vs_blake3_chain"}
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0
        assert len(result["spread"][name]["rounds"]) == hashing.QUICK_ROUNDS
    assert result["goals"] == {"hash_ns_per_token": {"max": 30.0}}
    assert result["met"]["hash_ns_per_token"] == (result["ratios"]["hash_ns_per_token"] <= 30)
    assert result["ratios"]["hash_ns_per_token"] == result["ns_per_token"]["keys_list_pt256"]
    assert {"keys_list_pt16", "blake3_chain_pt256", "canonical_tokens_list",
            "blake3_oneshot"} <= set(result["ns_per_token"])
    assert result["config"]["num_tokens"] == 2048 and not result["not_exercised"]


def test_the_timed_key_paths_agree_with_the_bare_chain_and_a_mismatch_fails_the_ratio():
    calls = hashing.calls_of(1024, hashing.PAGE_TOKENS)
    assert hashing.same_keys(calls, hashing.PAGE_TOKENS)
    assert len(calls["keys_list_pt256"]()) == 4
    rounds = {name: [1.0, 2.0, 3.0] for name in calls}
    report = harness.Report("hashing", "ns per token", {}, hashing.GOALS)
    hashing.add_ratios(report, rounds, keys_agree=False)
    assert report.ratios["hash_vs_blake3_chain"] is None
    assert report.ratios["hash_ns_per_token"] == 2.0
