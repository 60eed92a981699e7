"""`raykv status`'s routing rates (cluster/tools/rates_status.py), with Ray's actor table and
the replica actors faked: every engine replica is asked, others and dead ones are not."""

from __future__ import annotations

import pytest
from rich.console import Console

from cluster.tools import rates_status


class FakeReplica:
    def __init__(self, stats: dict):
        self.stats = stats
        self.record_routing_stats = self

    def remote(self) -> dict:
        return self.stats


def test_status_shows_each_replicas_rates_and_the_pooled_paths(monkeypatch):
    published = {"node_id": "node-a" * 4, "requests": 3, "rates": {
        "paths": {"remote": [5e8, 0.0, 4]}, "prefill_tokens_per_s": 1234.0,
        "prefill_samples": 3, "page_tokens": 16, "page_bytes": 1 << 20,
        "busy_s_per_request": 0.25, "lookups_beyond_vllm": 0.25, "lookup_delay_ms": 4.5,
        "lookups_timed": 40, "lookups_skipped": 60}}
    table = {"1": {"State": "ALIVE", "ActorClassName": "ServeReplica:raykv:EngineDeployment",
                   "Name": "SERVE_REPLICA::raykv#EngineDeployment#abc"},
             "2": {"State": "DEAD", "ActorClassName": "ServeReplica:raykv:EngineDeployment",
                   "Name": "gone"},
             "3": {"State": "ALIVE", "ActorClassName": "NodeCache", "Name": "node"}}
    asked = []

    def get_actor(name, namespace):
        asked.append((name, namespace))
        return FakeReplica(published)

    monkeypatch.setattr("ray._private.state.actors", lambda: table)
    monkeypatch.setattr(rates_status.ray, "get_actor", get_actor)
    monkeypatch.setattr(rates_status.ray, "get", lambda stats, timeout: stats)
    rates = rates_status.routing_rates()
    assert asked == [("SERVE_REPLICA::raykv#EngineDeployment#abc", "serve")]
    row = rates["replicas"]["SERVE_REPLICA::raykv#EngineDeployment#abc"]
    assert row["prefill_tokens_per_s"] == 1234.0 and row["busy_s_per_request"] == 0.25
    remote = rates["pooled"]["paths"]["remote"]
    assert remote["bytes_per_s"] == pytest.approx(5e8) and remote["num_samples"] == 4
    assert rates["pooled"]["paths"]["host"]["num_samples"] == 0  # a prior
    console = Console(record=True, width=200)
    for shown in rates_status.rates_tables(rates):
        console.print(shown)
    text = console.export_text()
    for expected in ("routing: fetch paths", "476.8 MiB/s", "free", "1,234", "0.250",
                     "node-anode-a", "25%", "4.5 ms", "60 of 100"):
        assert expected in text, (expected, text)
