"""`raykv bench ttft`'s pure parts: distinct prompts, the filler count, the exercised checks and
the per-repetition pairing. No Ray."""

from cluster.tools.bench import harness, ttft

PREFIX_BYTES = ttft.CACHED_TOKENS * ttft.KV_BYTES_PER_TOKEN


def _checks(host_used=ttft.CACHED_TOKENS, host_read=0, disk_read=PREFIX_BYTES) -> dict:
    return {"host": {"cached_tokens": [ttft.CACHED_TOKENS, host_used, ttft.CACHED_TOKENS],
                     "disk_bytes_read": [0, 0, host_read]},
            "disk": {"cached_tokens": [ttft.CACHED_TOKENS] * 3,
                     "disk_bytes_read": [PREFIX_BYTES, disk_read, PREFIX_BYTES + 4096]}}


def test_every_case_of_every_repetition_has_a_prompt_whose_first_page_is_its_own():
    first_pages = [text[:ttft.PAGE_TOKENS - 1] for rep in range(12)
                   for text in ttft.case_texts(rep).values()]
    assert len(set(first_pages)) == len(first_pages) == 12 * len(ttft.CASES)
    assert all(len(text) == ttft.PROMPT_TOKENS - 1 for text in ttft.case_texts(3).values())


def test_fillers_push_every_page_of_the_disk_prefix_off_the_host_tier():
    assert ttft.num_fillers(128, 30) == 5  # 150 filler pages after the prefix >= 128
    assert ttft.num_fillers(120, 30) * 30 > 120


def test_ratios_pair_repetitions_and_fail_when_a_tier_was_not_exercised():
    ttft_ms = {"host": [60.0, 50.0, 80.0], "disk": [90.0, 60.0, 100.0],
               "recompute": [240.0, 200.0, 220.0], "ideal": [60.0, 40.0, 100.0]}
    report = harness.Report("ttft", "ms", {}, ttft.GOALS)
    ttft.add_ratios(report, ttft_ms, _checks())
    assert report.ratios["ttft_host_vs_ideal"] == 1.0  # 1.0, 1.25, 0.8
    assert report["spread"]["ttft_host_vs_ideal"]["rounds"] == [1.0, 1.25, 0.8]
    assert report.ratios["ttft_disk_vs_ideal"] == 1.5  # 1.5, 1.5, 1.0
    assert report.ratios["ttft_speedup_host"] == 4.0  # 4, 4, 2.75
    for checks, failed in ((_checks(host_used=256), "host"), (_checks(host_read=4096), "host"),
                           (_checks(disk_read=PREFIX_BYTES - 1), "disk")):
        report = harness.Report("ttft", "ms", {}, ttft.GOALS)
        ttft.add_ratios(report, ttft_ms, checks)
        assert set(report["not_exercised"]) == {f"ttft_{failed}_vs_ideal",
                                                f"ttft_speedup_{failed}"}


class _Node:
    """A client whose node's disk reads move for the first `moving` stats calls (a read-up
    the request set off), then stand still."""

    def __init__(self, moving: int) -> None:
        self.calls, self.moving = 0, moving
        self.view = type("View", (), {"counters": {"disk_direct_pages": 3,
                                                   "disk_direct_us": 2500}})()
        self.geometry = type("Geometry", (), {"page_bytes": 1000})()

    def stats(self) -> dict:
        self.calls += 1
        moved = min(self.calls, self.moving)
        return {"node": {"disk_bytes_read": 4096 * moved, "disk_read_s": 0.001 * moved}}


def test_quiesce_waits_for_the_node_s_disk_reads_to_stand_still():
    client = _Node(moving=3)
    bench = ttft.Bench(None, client)
    try:
        bench.quiesce(timeout_s=5.0)
        assert client.calls == 4  # three that moved, then one that matched the last
        assert bench.disk_reads() == (3 * 4096 + 3 * 1000, (0.0025, 0.003))
        still = _Node(moving=10**6)  # never still: gives up at the timeout
        ttft.Bench(None, still).quiesce(timeout_s=0.2)
        assert 2 <= still.calls <= 6
    finally:
        bench.close()
