"""`raykv sim --part eviction`: the ratios' arithmetic, and the JSON and plot of a small
synthetic trace in Mooncake's format. No Ray."""

from __future__ import annotations

import gc
import json
import random

import pytest

from cluster.tools import sim, sim_parts


def test_eviction_ratios_take_the_worst_capacity():
    hit_ratio = {"raykv": [0.05, 0.2, 0.3], "belady": [0.2, 0.25, 0.3], "lru": [0.04, 0.2, 0.32]}
    ratios = sim.eviction_ratios([1000, 5000, 10000], hit_ratio)
    assert ratios["eviction_vs_belady_min"] == pytest.approx(0.8)  # C >= 5k only
    assert ratios["eviction_vs_lru_min"] == pytest.approx(0.3 / 0.32)
    assert sim.eviction_ratios([1000], {k: v[:1] for k, v in hit_ratio.items()}) == {
        "eviction_vs_belady_min": None, "eviction_vs_lru_min": pytest.approx(1.25)}


def write_trace(path, num_requests: int = 300, seed: int = 0) -> None:
    """Conversations that go on: each request extends an earlier one's prompt or starts anew
    from the shared block 0."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id = 1
    with open(path, "w") as file:
        for i in range(num_requests):
            base = rng.choice(prompts) if prompts and rng.random() < 0.6 else [0]
            num_new = rng.randint(1, 6)
            ids = base + list(range(next_id, next_id + num_new))
            next_id += num_new
            prompts.append(ids)
            row = {"timestamp": i * 100, "input_length": 512 * len(ids) - rng.randrange(2) * 100,
                   "output_length": 10, "hash_ids": ids}
            file.write(json.dumps(row) + "\n")


def test_a_small_trace_gives_every_policy_and_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(sim, "CAPACITIES_BLOCKS", (20, 50, 100, 5000))
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out = tmp_path / "sim.json"
    result = sim.run(str(trace), str(out), str(tmp_path / "sim.png"), ("eviction",),
                     sim.Bounds(limit=250))
    written = json.loads(out.read_text())
    eviction = written["eviction"]
    assert eviction["capacity_blocks"] == [20, 50, 100, 5000]
    assert set(eviction["hit_ratio"]) == {"raykv", "belady", *sim.EVICTION_POLICIES}
    assert eviction["hit_ratio"]["raykv"] == eviction["hit_ratio"][sim.default_policy()]
    for name, ratios in eviction["hit_ratio"].items():
        assert all(r <= b + 1e-12 for r, b in zip(ratios, eviction["hit_ratio"]["belady"],
                                                 strict=True)), name
    # 5000 blocks hold the whole trace: every policy reaches the unlimited cache
    for ratios in eviction["hit_ratio"].values():
        assert ratios[-1] == pytest.approx(eviction["unlimited_hit_ratio"])
    oracle = eviction["oracle_dead_first_lru"]
    assert len(oracle) == 4
    assert all(o <= b + 1e-12 for o, b in zip(oracle, eviction["hit_ratio"]["belady"],
                                              strict=True))
    assert oracle[-1] == pytest.approx(eviction["unlimited_hit_ratio"])
    assert written["config"]["num_requests"] == 250
    assert set(result["ratios"]) == set(sim.EVICTION_GOALS)
    assert (tmp_path / "sim.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="unknown part"):
        sim.run(str(trace), parts=("bogus",))


def test_routing_and_scale_parts_on_a_small_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(sim_parts, "SCALE_NODES", (4, 16))
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, num_requests=200)
    out = tmp_path / "sim.json"
    result = sim.run(str(trace), str(out), str(tmp_path / "sim.png"), ("routing", "scale"))
    written = json.loads(out.read_text())
    routers = written["routing"]["routers"]
    assert set(routers) == set(sim_parts.ROUTERS)
    assert all(f["num_requests"] == 4 * 200 for f in routers.values())  # 16 nodes: 4 copies
    assert routers["raykv"]["hit_ratio"] <= written["routing"]["global_bound_hit_ratio"] + 1e-9
    floor = written["routing"]["global_bound"]  # every request's own floor: so every percentile
    for figures in routers.values():
        assert figures["ttft_p50_s"] >= floor["ttft_floor_p50_s"] - 1e-12
        assert figures["ttft_p99_s"] >= floor["ttft_floor_p99_s"] - 1e-12
    assert all(routers[n]["cross_node_bytes"] == 0 for n in ("round_robin", "pow2", "dynamo"))
    per = written["scale"]["per_nodes"]
    assert [per[n]["num_requests"] for n in ("4", "16")] == [200, 800]
    assert result["ratios"]["sim_nodes_max"] == 16
    assert result["ratios"]["sim_speed_vs_realtime"] > 0
    # 1,024 nodes did not run: that ratio is not exercised, and the run fails
    assert result["ratios"]["directory_shard_imbalance"] is None
    assert "directory_shard_imbalance" in result["not_exercised"]
    assert (tmp_path / "sim.png").stat().st_size > 10_000


def test_the_default_policy_is_no_worse_than_lru_on_conversations(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, num_requests=800, seed=3)
    requests, chains = sim.trace_chains(str(trace))
    for capacity_blocks in (60, 250, 1000):
        raykv = sim.policy_hits(sim.default_policy(), chains, capacity_blocks)
        assert raykv >= sim.policy_hits("lru", chains, capacity_blocks), capacity_blocks
        assert raykv <= sim.policy_hits("belady", chains, capacity_blocks)


def test_paused_gc_pauses_the_collector_and_hands_back_no_walk():
    """Off inside; on again after, with the objects made inside moved out of the youngest
    generation (no collection walks them at the next allocation) and nothing left frozen."""
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        with sim_parts.paused_gc():
            assert not gc.isenabled()
            held = [[i] for i in range(50_000)]
            assert gc.get_count()[0] >= 50_000
            collections = [g["collections"] for g in gc.get_stats()]
        assert gc.isenabled()
        assert [g["collections"] for g in gc.get_stats()] == collections  # nothing walked
        assert any(o is held[0] for o in gc.get_objects(generation=2))  # moved to the oldest
        assert gc.get_freeze_count() == 0
        gc.disable()
        with sim_parts.paused_gc():
            pass
        assert not gc.isenabled()  # left as it was found
        assert len(held) == 50_000
    finally:
        if was_enabled:
            gc.enable()
        else:
            gc.disable()


def test_start_s_keeps_the_later_requests_rebased(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, num_requests=300)  # one request every 100 ms
    requests, chains = sim.trace_chains(str(trace))
    later, later_chains = sim.trace_chains(str(trace), limit=50, start_s=10.0)
    assert len(later) == 50
    assert [r.timestamp_ms for r in later] == [r.timestamp_ms - 10_000 for r in requests[100:150]]
    assert [r.block_ids for r in later] == [r.block_ids for r in requests[100:150]]
    assert later_chains == chains[100:150]
    assert len(sim.trace_chains(str(trace), start_s=10.0)[0]) == 200
    result = sim.run(str(trace), parts=("eviction",), bounds=sim.Bounds(start_s=25.0))
    assert result["config"]["start_s"] == 25.0 and result["config"]["num_requests"] == 50
