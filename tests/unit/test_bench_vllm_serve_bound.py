"""`raykv bench vllm-serve`'s TTFT bounds (vllm_serve_bound.py): what a cache that never evicts
and fetches for free would give on a baseline's own engines (no Ray, no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.core.trace_format import BLOCK_TOKENS, BlockRequest
from cluster.core.trace_scale import Scale
from cluster.tools.bench.harness import Report
from cluster.tools.bench.vllm_serve_bound import (
    BOUNDS,
    bound_ttft_ms,
    fill_ttft_bounds,
    prefill_ms_per_token,
)
from cluster.tools.bench.vllm_serve_trace import (
    Thinning,
    conversations,
    reusable_blocks,
    reusable_blocks_per_request,
    round_trace,
)


def request(at_ms: float, *blocks: int) -> BlockRequest:
    return BlockRequest(at_ms, len(blocks) * BLOCK_TOKENS + 10, 1, tuple(blocks))


def records(prompt, cached, ttft, prefill, index=None) -> dict:
    return {"index": index or list(range(len(prompt))), "prompt_tokens": prompt,
            "cached_tokens": cached, "ttft_ms": ttft, "engine_prefill_ms": prefill}


def test_each_request_is_given_the_blocks_an_earlier_request_sent():
    # as in test_bench_vllm_serve: every request starts with the system block 0
    trace = [request(0, 0, 10), request(1, 0, 20), request(2, 0, 10, 11), request(3, 0, 30),
             request(4, 0, 20, 21), request(5, 0, 10, 11, 12)]
    scaled = round_trace(conversations(trace), Thinning(2, 120, 1.0), 0, Scale(32, 1.0, 1))
    assert [r.block_ids for r in scaled] == [(0, 10), (0, 10, 11), (0, 30), (0, 10, 11, 12)]
    # (0,10): 0 was not sent before | (0,10,11): 0, 0-10 | (0,30): 0 | (0,10,11,12): 3
    assert reusable_blocks_per_request(scaled) == [0, 2, 1, 3]
    assert reusable_blocks(scaled) == (6, 11)


def test_the_prefill_rate_is_the_baseline_s_own_slope():
    # 2 ms fixed + 0.5 ms a token, exactly
    fitted = records([100, 50, 30], [0, 10, 10], [0, 0, 0], [52.0, 22.0, 12.0])
    assert prefill_ms_per_token(fitted) == pytest.approx(0.5)
    # untimed requests are left out; one token count alone gives no slope
    assert prefill_ms_per_token(records([100, 100], [0, 0], [0, 0], [5.0, None])) == 0.0


def test_a_request_gains_only_the_reusable_tokens_it_lacked_and_keeps_one_to_prefill():
    # engine prefill = 1 ms a token, exactly
    recs = records(prompt=[200, 100, 64], cached=[32, 96, 0], ttft=[300.0, 50.0, 90.0],
                   prefill=[168.0, 4.0, 64.0], index=[0, 1, 2])
    assert prefill_ms_per_token(recs) == pytest.approx(1.0)
    # request 0: 160 reusable, had 32 -> 128 ms less; request 1: reusable 96 = cached -> as
    # measured; request 2: 64 reusable but one token must be prefilled -> 63 ms less
    assert bound_ttft_ms(recs, [160, 96, 64]) == pytest.approx([172.0, 50.0, 27.0])
    # a request that had more cached than the bound counts (another replica's engine) loses
    # nothing
    assert bound_ttft_ms(recs, [0, 0, 0]) == pytest.approx([300.0, 50.0, 90.0])


def test_the_ratios_are_per_round_percentiles_of_the_bound_over_the_baseline():
    report = Report("vllm-serve", "ms", {}, {})
    base = records(prompt=[200, 100, 64], cached=[32, 96, 0], ttft=[300.0, 50.0, 90.0],
                   prefill=[168.0, 4.0, 64.0])
    rounds = {"kv-aware": [base, base, base], "prefix": [base, base, base]}
    reusable = [[160, 96, 64], [0, 0, 0], [160, 96, 64]]
    fill_ttft_bounds(report, rounds, reusable)
    p50 = np.median([172.0, 50.0, 27.0]) / np.median([300.0, 50.0, 90.0])
    assert report.ratios["ttft_p50_bound_vs_kv_aware"] == pytest.approx(p50)
    assert report.result["spread"]["ttft_p50_bound_vs_kv_aware"]["rounds"] == \
        pytest.approx([p50, 1.0, p50])
    assert set(BOUNDS) <= set(report.ratios)
    assert report.ratios["ttft_p99_bound_vs_kv_aware"] < 1.0


def test_a_missing_baseline_is_not_exercised_not_a_figure():
    report = Report("vllm-serve", "ms", {}, {})
    base = records([200, 100], [0, 0], [10.0, 20.0], [5.0, 3.0])
    fill_ttft_bounds(report, {"kv-aware": [base, base, base]}, [[0, 0]] * 3)
    assert report.ratios["ttft_p50_bound_vs_prefix_router"] is None
    assert "prefix" in report.result["not_exercised"]["ttft_p50_bound_vs_prefix_router"]


def test_a_round_with_no_answered_request_is_not_exercised():
    report = Report("vllm-serve", "ms", {}, {})
    base = records([200, 100], [0, 0], [10.0, 20.0], [5.0, 3.0])
    empty = records([], [], [], [])
    fill_ttft_bounds(report, {"kv-aware": [base, empty, base], "prefix": [base] * 3},
                     [[0, 0]] * 3)
    assert report.ratios["ttft_p50_bound_vs_kv_aware"] is None
    assert "no request" in report.result["not_exercised"]["ttft_p99_bound_vs_kv_aware"]
    assert report.ratios["ttft_p50_bound_vs_prefix_router"] == pytest.approx(1.0)
