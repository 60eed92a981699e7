"""`raykv bench vllm-serve`'s pure parts: the thinned trace, the kv-aware set-up's ports, the
replica shares and when a comparison counts as exercised (no Ray, no vLLM)."""

from __future__ import annotations

import pytest

from cluster.core.trace_format import BLOCK_TOKENS, BlockRequest
from cluster.core.trace_scale import Scale
from cluster.tools.bench import vllm_serve
from cluster.tools.bench.harness import Report
from cluster.tools.bench.vllm_serve_setups import (
    KV_TOKEN_PORT_BASE_KEY,
    EngineShape,
    ported_engine_kwargs,
)
from cluster.tools.bench.vllm_serve_trace import (
    Thinning,
    common_blocks,
    conversations,
    distinct_blocks,
    prefix_reuse,
    reusable_blocks,
    round_requests,
    round_trace,
    truncated,
)


def request(at_ms: float, *blocks: int) -> BlockRequest:
    return BlockRequest(at_ms, len(blocks) * BLOCK_TOKENS + 10, 1, tuple(blocks))


# Every request starts with the system block 0; conversations own 10.., 20.., 30...
TRACE = [request(0, 0, 10), request(1, 0, 20), request(2, 0, 10, 11), request(3, 0, 30),
         request(4, 0, 20, 21), request(5, 0, 10, 11, 12)]


def test_conversations_group_requests_by_their_first_own_block():
    assert common_blocks(TRACE) == {0}
    groups = conversations(TRACE)
    assert [[r.timestamp_ms for r in g] for g in groups] == [[0, 2, 5], [1, 4], [3]]


def test_a_round_keeps_every_nth_conversation_from_its_offset_in_time_order():
    groups = conversations(TRACE)
    thinning = Thinning(every=2, max_blocks=120, speedup=1.0)
    assert [r.timestamp_ms for r in round_requests(groups, thinning, 0)] == [0, 2, 3, 5]
    assert [r.timestamp_ms for r in round_requests(groups, thinning, 1)] == [1, 4]


def test_requests_are_cut_to_the_engines_context():
    long = request(0, *range(200))
    cut = truncated(long, 120)
    assert cut.block_ids == tuple(range(120)) and cut.input_tokens < 120 * BLOCK_TOKENS
    short = request(0, 1, 2)
    assert truncated(short, 120) is short


def test_the_scaled_round_keeps_prefixes_and_its_clock_runs_faster():
    groups = conversations(TRACE)
    scaled = round_trace(groups, Thinning(2, 120, speedup=2.0), 0, Scale(32, 1.0, 1))
    assert [r.send_at_s for r in scaled] == [0.0, 0.001, 0.0015, 0.0025]
    first, second = scaled[0], scaled[1]
    assert second.text.startswith(first.text[: 2 * 32 - 1])
    # (0,10) | (0,10,11): 2 seen | (0,30): 1 seen | (0,10,11,12): 3 seen; 11 blocks sent,
    # 5 distinct prefixes
    assert distinct_blocks(scaled) == 5
    assert prefix_reuse(scaled) == 6 / 11
    assert reusable_blocks(scaled) == (6, 11)


def test_the_kv_aware_ports_move_to_free_ones_net_of_ray_s_rank_offset():
    engine = {"block_size": 32, "kv_events_config": {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:6557"}}
    moved, experimental = ported_engine_kwargs(engine, {"x": 1}, rank=2,
                                               ports=(40001, 40002, 40003))
    assert moved["kv_events_config"]["endpoint"] == "tcp://*:39999"
    assert moved["kv_events_config"]["replay_endpoint"] == "tcp://*:40000"
    assert moved["kv_events_config"]["publisher"] == "zmq" and moved["block_size"] == 32
    assert experimental == {"x": 1, KV_TOKEN_PORT_BASE_KEY: 40001}
    assert engine["kv_events_config"]["endpoint"] == "tcp://*:5557"  # not changed in place
    untouched = {"block_size": 32}
    assert ported_engine_kwargs(untouched, {}, 0, (1, 2, 3)) == (untouched, {})


def test_every_set_up_runs_the_same_engines():
    kwargs = EngineShape(num_blocks=256).engine_kwargs()
    assert kwargs["num_gpu_blocks_override"] == 256 and kwargs["block_size"] == 32
    assert kwargs["enable_prefix_caching"] and kwargs["enable_prompt_tokens_details"]
    assert kwargs["enable_per_request_metrics"]  # the per-request TTFT split


def test_replica_shares_count_only_the_requests_between_two_scrapes():
    assert vllm_serve.shares({"a": 3.0}, {"a": 5.0, "b": 6.0}) == {"a": 0.25, "b": 0.75}
    assert vllm_serve.shares({"a": 3.0}, {"a": 3.0}) == {}
    assert vllm_serve.shares({"old": 9.0}, {"old": 9.0, "b": 2.0}) == {"b": 1.0}


def _round(errors=0, cached=100, p50=10.0, shares=None):
    return {"summary": {"requests": 10, "errors": errors, "cached_tokens": cached,
                        "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50,
                        "replica_shares": shares if shares is not None else {"a": 0.4, "b": 0.6}},
            "error_samples": ["503"] if errors else []}


def _report(rounds, working_set=(2000, 2000, 2000)):
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    vllm_serve.fill_ratios(report, rounds, vllm_serve.QUICK_PLAN, list(working_set))
    return report


def test_ratios_pair_raykv_with_kv_aware_per_round_and_decisions_are_not_exercised():
    rounds = {"raykv": [_round(p50=5.0, cached=300)] * 3, "kv-aware": [_round()] * 3,
              "prefix": [_round(p50=20.0)] * 3, "pow2": [_round()] * 3}
    report = _report(rounds)
    assert report.ratios["ttft_p50_vs_kv_aware"] == 0.5
    assert report.ratios["cached_tokens_vs_kv_aware"] == 3.0
    assert report.ratios["ttft_p50_vs_prefix_router"] == 0.25
    assert report.ratios["max_replica_share"] == 0.6
    assert report.ratios["recompute_decisions_correct"] is None
    assert "recompute_decisions_correct" in report["not_exercised"]


def test_failed_requests_no_hits_or_a_working_set_that_fits_are_not_exercised():
    good = {"raykv": [_round()] * 3, "kv-aware": [_round()] * 3, "prefix": [_round()] * 3,
            "pow2": [_round()] * 3}
    failing = {**good, "kv-aware": [_round(errors=10)] * 3}
    assert _report(failing).ratios["ttft_p50_vs_kv_aware"] is None
    assert "failed 10 of 10" in _report(failing)["not_exercised"]["ttft_p50_vs_kv_aware"]
    assert _report(failing).ratios["ttft_p50_vs_prefix_router"] is not None
    no_hits = {**good, "raykv": [_round(cached=0)] * 3}
    assert _report(no_hits).ratios["ttft_p99_vs_kv_aware"] is None
    fits = _report(good, working_set=(2000, 100, 2000))
    assert "memory was no limit" in fits["not_exercised"]["cached_tokens_vs_kv_aware"]
    unnamed = {**good, "raykv": [_round(shares={})] * 3}
    assert _report(unnamed).ratios["max_replica_share"] is None


def test_a_quick_run_leaves_out_only_pow2_which_no_ratio_reads():
    assert vllm_serve.setups_for(False) == ("raykv", "kv-aware", "prefix", "pow2")
    assert vllm_serve.setups_for(True) == ("raykv", "kv-aware", "prefix")



def test_chosen_set_ups_run_in_order_and_ratios_without_theirs_are_not_exercised():
    assert vllm_serve.setups_for(False, ("prefix", "raykv")) == ("raykv", "prefix")
    with pytest.raises(ValueError, match="unknown set-ups"):
        vllm_serve.setups_for(True, ("raykv", "lmcache"))
    report = _report({"raykv": [_round()] * 3, "prefix": [_round(p50=20.0)] * 3})
    assert "kv-aware was not among" in report["not_exercised"]["ttft_p50_vs_kv_aware"]
    assert report.ratios["ttft_p50_vs_prefix_router"] == 0.5
    assert "raykv was not among" in _report({"prefix": [_round()] * 3})["not_exercised"][
        "ttft_p50_vs_prefix_router"]

def test_the_compat_finder_answers_only_a_moved_module_name(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(vllm_serve.__file__).parent / "vllm_compat" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("raykv_vllm_compat_under_test", path)
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    finder = sys.meta_path[-1]
    try:
        assert compat.MOVED == {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}
        monkeypatch.setitem(compat.MOVED, "raykv_moved_json_for_test", "json")
        import json

        assert importlib.import_module("raykv_moved_json_for_test") is json
        assert finder.find_spec("json.decoder") is None
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("raykv_moved_json_for_test", None)


def test_the_bound_pairs_what_a_cache_that_never_evicts_serves_with_kv_aware_s_cache():
    rounds = {"raykv": [_round()] * 3, "kv-aware": [_round(cached=100)] * 3,
              "prefix": [_round()] * 3, "pow2": [_round()] * 3}
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    vllm_serve.fill_ratios(report, rounds, vllm_serve.QUICK_PLAN, [2000] * 3,
                           reusable_tokens=[120, 125, 130])
    assert report.ratios["cached_tokens_bound_vs_kv_aware"] == 1.25
    assert "cached_tokens_bound_vs_kv_aware" not in report["goals"]  # a bound, not a goal
    failing = {**rounds, "kv-aware": [_round(errors=10)] * 3}
    report = Report("vllm-serve", "ms", {}, vllm_serve.GOALS)
    vllm_serve.fill_ratios(report, failing, vllm_serve.QUICK_PLAN, [2000] * 3,
                           reusable_tokens=[120, 125, 130])
    assert report.ratios["cached_tokens_bound_vs_kv_aware"] is None


def test_raykvs_tiers_stand_to_the_engines_own_cache_as_a_gpu_nodes_dram_and_nvme_do():
    from cluster.core.config import MiB
    from cluster.core.sim_profiles import PROFILES
    from cluster.core.spec import ModelSpec

    node = PROFILES[vllm_serve.TIERS_PROFILE]
    vllm_kv_bytes = 0.9 * node.hbm_bytes - 141e9  # what LLaMA3-70B's weights and a reserve leave
    for plan in (vllm_serve.PLAN, vllm_serve.QUICK_PLAN):
        engine = plan.engine
        engine_kv_bytes = (engine.num_blocks * engine.block_tokens
                           * ModelSpec.preset(vllm_serve.MODEL).bytes_per_token)
        # within the MiB the tiers are rounded down to
        assert plan.host_bytes % MiB == 0 and plan.disk_bytes % MiB == 0
        host_ratio = node.host_kv_bytes / vllm_kv_bytes
        disk_ratio = node.disk_kv_bytes / vllm_kv_bytes
        assert plan.host_bytes == pytest.approx(engine_kv_bytes * host_ratio, abs=MiB)
        assert plan.disk_bytes == pytest.approx(engine_kv_bytes * disk_ratio, abs=MiB)
        assert 2 < plan.host_bytes / engine_kv_bytes < 2.5  # 1 TB of DRAM against ~435 GB
        assert 17 < plan.disk_bytes / engine_kv_bytes < 18  # 7.68 TB of NVMe


def test_every_set_ups_engines_bind_their_threads_alike():
    """vLLM reserves one more core for an engine with a KV connector: on 2 cores raykv's
    engines got both cores and the baselines' one. Every engine now gets the same reservation
    (raykv_app applies the same `engine_env` over its LLMConfig's)."""
    from cluster.tools.bench import vllm_serve_setups as setups

    env = setups.placement(1)["runtime_env"]["env_vars"]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert setups.engine_env(2)["VLLM_CPU_KVCACHE_SPACE"] == "2"

