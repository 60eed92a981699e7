"""Smoke test of `raykv bench hashing` on a tiny prompt: the output's shape, no Ray."""

import json
import math

from cluster.tools.bench import hashing


def test_run_writes_ratios_goals_and_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "QUICK_TOKENS", 2048)
    monkeypatch.setattr(hashing, "QUICK_REPS", 1)
    json_path = tmp_path / "hashing.json"

    result = hashing.run(str(json_path), quick=True)

    assert json.loads(json_path.read_text()) == result
    assert set(result["ratios"]) == {"hash_ns_per_token", "hash_ns_per_token_list",
                                     "hash_ns_per_token_pt16", "hash_vs_blake3_chain"}
    for value in result["ratios"].values():
        assert isinstance(value, float) and math.isfinite(value) and value > 0
    assert result["goals"] == {"hash_ns_per_token": {"max": 30.0}}
    assert set(result["met"]) == {"hash_ns_per_token"}
    assert result["met"]["hash_ns_per_token"] == (result["ratios"]["hash_ns_per_token"] <= 30)
    assert set(result["per_page_tokens"]) == {"256", "16"}
    for figures in result["per_page_tokens"].values():
        assert set(figures) == {"page_keys_numpy", "page_keys_list", "chain_keys_only",
                                "blake3_chain", "xxh3_128_chain"}
        assert all(v > 0 for v in figures.values())
    assert {"blake3_oneshot", "xxh3_128_oneshot", "memcpy"} <= set(result["whole_prompt"])
    assert result["config"]["num_tokens"] == 2048
    assert result["machine"]["nproc"] >= 1

