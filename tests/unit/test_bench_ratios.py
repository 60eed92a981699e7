"""The benchmarks' pure parts: plans, service sizing, ratios and the directory breakdown. No Ray."""

import pytest

from cluster.tools.bench import common, directory, faults, harness, remote, tiers
from cluster.tools.bench.remote_peer import prompt_tokens


def test_tiers_plans_whole_token_pages_and_a_host_tier_for_every_put():
    plan = tiers.plan_for(4, False, "/tmp")
    assert plan.page_tokens == 32 and plan.num_pages == 16
    assert plan.batch_bytes == tiers.BATCH_BYTES
    assert plan.disk_rounds == tiers.DISK_ROUNDS
    assert tiers.plan_for(1, False, "/tmp").disk_rounds == 1
    config = tiers._service_config(plan)
    host_batches = config.host_bytes // plan.batch_bytes
    # batch 0, the warm-up, rounds x (timed puts + puts taken apart), one spare
    assert host_batches == 2 + plan.rounds * 2 * tiers.PUT_REPS + 1
    assert config.device_bytes == 0 and config.eviction == "lru"


def test_tiers_ratios_pair_rounds_and_summarise_prefers_the_ratio_size():
    host = {"get": [3.0, 4.0, 2.0], "put": [1.0, 1.0, 1.0], "memcpy": [6.0, 8.0, 4.0]}
    disk = {"arena_read": [1.0], "fio_read": [1.0], "arena_write": [0.9], "fio_write": [1.0],
            "arena_durable_write": [0.6], "fio_durable_write": [0.5]}
    raw = {"host_get": 3.0, "redis_get": 0.5, "ray_remote_get": 6.0, "ray_get": 3.0,
           "disk_e2e_get": 0.5, "disk_e2e_put": 0.5, "fio_read": 1.0, "fio_write": 1.0}
    ratios = tiers.size_ratios(host, disk, raw)
    assert ratios["host_get_vs_memcpy"] == 0.5
    assert ratios["host_get_vs_redis"] == 6.0 and ratios["host_get_vs_ray"] == 0.5
    assert ratios["disk_write_vs_raw"] == pytest.approx(0.9)
    assert ratios["durable_write_vs_raw"] == pytest.approx(1.2)
    assert ratios["durable_write_vs_volatile"] == pytest.approx(0.6 / 0.9)
    assert "durable_write_vs_raw" in tiers.GOALS
    main, geomean = tiers.summarise({"1MiB": {"ratios": {"r": 1.0}},
                                     "4MiB": {"ratios": {"r": 4.0}}})
    assert main == {"r": 4.0} and geomean["r"] == pytest.approx(2.0)
    main, _ = tiers.summarise({"1MiB": {"ratios": {"r": 1.0}}, "16MiB": {"ratios": {"r": 4.0}}})
    assert main["r"] == pytest.approx(2.0)


def _shard_figures(match_ms: float, ping_ms: float) -> dict:
    names = ("ping", "ping_all", "shard_match", "match", "lookup_e2e", "redis_exists")
    figures = {f"{n}_{s}_ms": 1.0 for n in names for s in ("p50", "p99")}
    figures.update(match_p50_ms=match_ms, ping_p50_ms=ping_ms, redis_exists_p50_ms=6.0)
    figures["cpu_us_per_call"] = {n: {"server_us": 1.0, "client_us": 1.0}
                                  for n in directory.CPU_CALLS}
    figures["throughput_keys_per_s"] = {"1": 1e5, "2": 2e5}
    return figures


def test_directory_ratios_use_match_over_ping_and_redis_over_match():
    ratios = directory.ratios_of({"1": _shard_figures(3.0, 2.0), "2": _shard_figures(4.0, 2.0)})
    assert ratios["lookup_p50_vs_noop_rpc"] == 1.5
    assert ratios["directory_vs_redis"] == 2.0
    assert ratios["match_p50_2_vs_1_shards"] == pytest.approx(4 / 3)
    assert ratios["shard_scaling_1_to_2"] == 1.0
    assert set(directory.GOALS) <= set(ratios)


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


@pytest.mark.parametrize("stalled_writes, wrong, met", [(2, 0, True), (0, 0, False),
                                                        (2, 1, False)])
def test_the_stalled_writer_fault_fails_on_wrong_bytes_and_when_nothing_stalled(
        stalled_writes, wrong, met):
    fault = {"wrong_bytes": 0, "client_errors": 0, "recovery_s": 1.0}
    per_fault = {"node": dict(fault), "stalled_writer": {
        **fault, "wrong_bytes": wrong, "stalled_writes": stalled_writes}}
    soak = {"wrong_bytes": 0, "client_errors": 0, "rss_growth": 0.0, "leases": 0,
            "reservations": 0, "files_left": 0}
    ratios = faults.ratios_of({"per_fault": per_fault, "fuzz": {"cases": 10_000,
                                                                "failures": 0}}, soak)
    assert ratios["stalled_writer_wrong_bytes"] == wrong
    verdict = common.goals_met(ratios, faults.goals_for(ratios))
    assert (verdict["stalled_writer_wrong_bytes"] and verdict["stalled_writes"]) is met
