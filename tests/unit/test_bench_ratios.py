"""The benchmarks' pure parts: plans, service sizing, ratios and the directory breakdown. No Ray."""

import pytest

from cluster.tools.bench import directory, harness, remote, tiers
from cluster.tools.bench.remote_peer import prompt_tokens
from cluster.tools.redis_server import RedisServer, redis_server_path


def test_tiers_plans_whole_token_pages_and_a_host_tier_for_every_put():
    plan = tiers.plan_for(4, False, "/tmp")
    assert plan.page_tokens == 32 and plan.num_pages == 16
    assert plan.batch_bytes == tiers.BATCH_BYTES and plan.rounds == tiers.ROUNDS
    assert tiers.plan_for(4, True, "/tmp").rounds >= 3 and plan.disk_rounds >= 3
    config = tiers._service_config(plan)
    # batch 0, the warm-up, rounds x timed puts, the puts taken apart (reserved and leased),
    # one spare, and the batches the client's slot lease may hold ahead (put_lease_bytes)
    assert config.put_lease_bytes == 4 * plan.batch_bytes
    assert config.host_bytes // plan.batch_bytes == (2 + (plan.rounds + 2) * tiers.PUT_REPS
                                                     + 1 + 4)
    assert config.device_bytes == 0 and config.eviction == "lru"
    disk_slots = config.disk_bytes // (tiers.DISK_HEADER_BYTES + plan.page_bytes)
    # what the fill pushes down (one more than the e2e gets read), every e2e put's batch
    assert disk_slots >= (plan.num_e2e_gets + 1 + plan.disk_rounds * tiers.E2E_REPS) * 16


def test_tiers_full_puts_fill_a_small_host_tier_over_a_disk_that_takes_every_batch():
    from cluster.tools.bench import tiers_full

    plan = tiers.plan_for(4, False, "/tmp")
    config = tiers_full.full_config(plan)
    assert config.host_bytes == tiers_full.FULL_HOST_BATCHES * plan.batch_bytes
    assert tiers_full.FILL_PUTS > tiers_full.FULL_HOST_BATCHES  # full before any timed put
    assert config.demote_ahead and config.device_bytes == 0  # the node's defaults
    disk_slots = config.disk_bytes // (tiers.DISK_HEADER_BYTES + plan.page_bytes)
    puts = tiers_full.FILL_PUTS + plan.rounds * tiers_full.FULL_PUTS
    assert disk_slots >= puts * plan.num_pages  # nothing is dropped: every put can go down
    assert config.disk_dir != tiers._service_config(plan).disk_dir
    assert tiers.GOALS["host_put_full_vs_memcpy"] == tiers.GOALS["host_put_vs_memcpy"]


def _tiers_rounds() -> dict[str, list[float]]:
    rounds = {name: [1.0, 1.0, 1.0] for pair in tiers.RATIOS.values() for name in pair}
    rounds.update(get=[3.0, 4.0, 2.0], memcpy_get=[6.0, 4.0, 4.0], redis_get=[0.5, 1.0, 0.1])
    return rounds


def test_tiers_ratios_are_medians_of_per_round_ratios_with_their_spread():
    result = tiers.size_result(_tiers_rounds(), {})
    assert result["ratios"]["host_get_vs_memcpy"] == 0.5
    assert result["spread"]["host_get_vs_memcpy"] == {"min": 0.5, "max": 1.0,
                                                      "rounds": [0.5, 1.0, 0.5]}
    assert result["ratios"]["host_get_vs_redis"] == 6.0
    assert result["gbps"]["get"] == 3.0 and result["not_exercised"] == {}
    assert set(tiers.GOALS) < set(tiers.RATIOS)
    assert "host_get_cold_vs_memcpy" not in tiers.GOALS  # reported, no goal


def test_tiers_a_path_not_taken_nulls_every_ratio_that_uses_its_figure():
    result = tiers.size_result(_tiers_rounds(), {"get": "asked the node",
                                                 "e2e_get": "no disk read"})
    uses_get = {n for n, pair in tiers.RATIOS.items() if "get" in pair}
    assert uses_get == {"host_get_vs_memcpy", "host_get_vs_redis", "host_get_vs_ray"}
    nulled = {n for n, v in result["ratios"].items() if v is None}
    assert nulled == uses_get | {"disk_e2e_get_vs_raw_read"} == set(result["not_exercised"])
    assert result["not_exercised"]["host_get_vs_ray"] == "get: asked the node"
    assert result["ratios"]["host_get_cold_vs_memcpy"] == 0.25


def _shard_figures(match_ms: list[float], wrong_matches: int = 0,
                   redis_prefix: int = directory.PARTIAL_PAGES) -> dict:
    agreement = {"expected": [directory.NUM_PAGES, directory.PARTIAL_PAGES],
                 "raykv": [directory.NUM_PAGES, directory.PARTIAL_PAGES],
                 "redis": [directory.NUM_PAGES, redis_prefix]}
    return {"p50_ms_per_round": {"noop": [2.0, 1.0, 4.0], "match": match_ms,
                                 "lookup_e2e": [6.0, 6.0, 6.0], "redis": [12.0, 12.0, 12.0]},
            "wrong_answers": {"noop": 0, "match": wrong_matches, "lookup_e2e": 0, "redis": 0},
            "prefix_agreement": agreement}


def _directory_report(per_shards: dict) -> harness.Report:
    report = harness.Report("directory", "ms", {}, directory.GOALS)
    directory.add_ratios(report, per_shards)
    return report


def test_directory_ratios_pair_rounds_per_shard_count():
    report = _directory_report({"1": _shard_figures([3.0, 1.0, 10.0]),
                                "2": _shard_figures([4.0, 4.0, 4.0])})
    # per round: match / noop = 1.5, 1.0, 2.5; redis / match = 4, 12, 1.2
    assert report.ratios["lookup_p50_vs_noop_rpc"] == 1.5
    assert report["spread"]["lookup_p50_vs_noop_rpc"]["rounds"] == [1.5, 1.0, 2.5]
    assert report.ratios["directory_vs_redis"] == 4.0
    assert report.ratios["lookup_p50_vs_noop_rpc_2_shards"] == 2.0
    assert set(directory.GOALS) <= set(report.ratios)
    assert not report["not_exercised"]


def test_directory_ratios_fail_on_a_wrong_answer_or_a_disagreeing_redis_walk():
    report = _directory_report({"1": _shard_figures([3.0, 3.0, 3.0], wrong_matches=1)})
    assert report.ratios["lookup_p50_vs_noop_rpc"] is None
    assert report.ratios["directory_vs_redis"] is None
    assert report.ratios["lookup_e2e_p50_vs_noop_rpc"] == 3.0
    report = _directory_report({"1": _shard_figures([3.0, 3.0, 3.0], redis_prefix=299)})
    assert report.ratios["lookup_p50_vs_noop_rpc"] == 1.5
    assert report.ratios["directory_vs_redis"] is None
    assert "disagree" in report["not_exercised"]["directory_vs_redis"]
    assert harness.failed(report.finish(None)) == report["not_exercised"]


@pytest.mark.skipif(redis_server_path() is None, reason="redis-server not installed")
def test_the_redis_lua_walk_stops_at_the_first_missing_key():
    keys = directory.missing_keys(8)
    with RedisServer() as server:
        walk = directory.RedisPrefixWalk(server.url, keys[:5])
        try:
            assert walk.longest_prefix() == 5
            assert walk.longest_prefix(keys) == 5
            assert walk.longest_prefix([keys[0], keys[6], keys[1]]) == 1
            assert walk.longest_prefix(keys[6:]) == 0
        finally:
            walk.close()


def test_directory_breakdown_without_ray_answers_one_run():
    figures = directory.measure_breakdown(1)
    assert figures["answer_runs"] == 1
    assert figures["keys_blob_bytes"] == directory.NUM_PAGES * 16
    assert all(value > 0 for value in figures.values())


def test_remote_sizes_host_tiers_for_every_prompt_and_reads_whole_token_pages():
    plan = remote.QUICK
    assert plan.num_rounds >= 3 and plan.page_mib[0] == remote.RATIO_PAGE_MIB
    # a fresh prompt read and one pulled per round and warm-up, the data plane's, no repeats
    assert len(set(plan.prompts)) == len(plan.prompts) == 2 * (plan.num_rounds + 1) + 1
    config = remote._service_config(plan, 4 << 20, "/tmp")
    assert config.host_bytes == 2 * len(plan.prompts) * plan.prompt_bytes
    assert config.page_tokens == 32 and not config.rebalance
    tokens = prompt_tokens(1, plan.prompt_bytes)
    assert len(tokens) * remote.SPEC.bytes_per_token == plan.prompt_bytes


def test_the_raw_stream_uses_raykvs_lanes_and_split():
    from cluster.core.dataplane.reader import LANES
    from cluster.core.geometry import PageGeometry
    from cluster.tools.bench.tcp_peer import lane_bounds, raykv_lanes

    geometry = PageGeometry.of(remote.SPEC, 32)  # 4 MiB pages
    assert raykv_lanes(geometry, remote.QUICK.prompt_bytes >> 22) == LANES == 2
    assert raykv_lanes(geometry, 1) == 1  # one page: one connection
    assert lane_bounds(8, 2) == [(0, 4), (4, 8)] and lane_bounds(5, 2) == [(0, 2), (2, 5)]


def test_the_raw_stream_fills_every_page_over_its_lanes():
    from cluster.tools.bench import peers
    from cluster.tools.bench.tcp_peer import StreamReader, StreamServer

    server = StreamServer("127.0.0.1", peers.page_pool(4096, 5))
    reader = StreamReader(server.address, 2)
    try:
        out = peers.touched_buffer(4096, 5)
        rows = [(memoryview(page[:1000]), memoryview(page[1000:])) for page in out]
        assert reader.read_s(rows) > 0
        peers.check_pool(out)
    finally:
        reader.close()
        server.close()


def _remote_report(phases: dict) -> dict:
    report = harness.Report("remote", "GB/s", {}, remote.GOALS)
    gbps = {"raykv": [2.0, 2.4, 1.0], "tcp": [2.5, 3.0, 2.0], "ray": [0.5, 0.6, 0.5],
            "replication": [2.0, 3.0, 2.0], "tcp_rows": [2.0, 2.0, 2.0],
            "dataplane": [2.5, 2.4, 2.0]}
    remote.size_ratios(report, gbps, remote.exercised_of(phases, 8), "")
    return report.result


def test_remote_ratios_pair_rounds_and_fail_when_not_every_page_moved():
    whole = {"remote_pages": [8, 8, 8], "replicated_pages": [8, 8, 8],
             "resident_pages": [8, 8, 8]}
    result = _remote_report(whole)
    assert result["ratios"]["remote_get_vs_tcp"] == pytest.approx(0.8)
    assert result["spread"]["remote_get_vs_tcp"]["rounds"] == pytest.approx([0.8, 0.8, 0.5])
    assert result["ratios"]["replication_vs_tcp"] == pytest.approx(1.0)
    assert result["ratios"]["remote_get_vs_ray"] == 4.0 and not result["not_exercised"]
    assert set(remote.GOALS) <= set(result["ratios"])
    partial = _remote_report({**whole, "remote_pages": [8, 7, 8], "resident_pages": [8, 8, 0]})
    assert partial["ratios"]["remote_get_vs_tcp"] is None
    assert partial["ratios"]["replication_vs_tcp"] is None
    assert set(harness.failed(partial)) == {"remote_get_vs_tcp", "remote_get_vs_ray",
                                            "replication_vs_tcp", "remote_get_vs_dataplane"}
    assert partial["ratios"]["dataplane_vs_tcp"] is not None


def test_vllm_workload_alternates_engines_and_counts_cross_engine_tokens():
    from cluster.tools.bench.vllm_workload import (
        DOC_TOKENS,
        SYSTEM_TOKENS,
        TURN_TOKENS,
        HitAccount,
        workload,
    )

    requests = workload(num_sessions=2, num_turns=2)
    assert [(r.engine, r.session, r.turn) for r in requests] == [
        (0, 0, 0), (1, 1, 0), (1, 0, 1), (0, 1, 1)]
    assert requests[2].prompt[: len(requests[0].prompt)] == requests[0].prompt
    account = HitAccount(block_tokens=128)
    expected = [account.expect(r) for r in requests]
    first_turn = SYSTEM_TOKENS + DOC_TOKENS + TURN_TOKENS  # 2176: 17 whole blocks
    assert expected[0] == (0, 0)
    assert expected[1] == (0, SYSTEM_TOKENS)  # the system prefix, computed by engine 0
    assert expected[2] == (SYSTEM_TOKENS, first_turn - SYSTEM_TOKENS)
    assert expected[3] == expected[2]  # session 1's first turn was engine 1's
    assert len(requests[3].prompt) == first_turn + TURN_TOKENS
