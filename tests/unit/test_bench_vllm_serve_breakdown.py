"""The per-request TTFT split of `raykv bench vllm-serve` (pure: no Ray, no vLLM)."""

from __future__ import annotations

from cluster.tools.bench.trace import Sent
from cluster.tools.bench.vllm_serve_breakdown import columns, paired, report_fields, split


def sent(index: int, ttft_ms: float, queue_ms: float | None, prefill_ms: float | None,
         cached: int = 0, status: int = 200) -> Sent:
    return Sent(index, status, sent_at_s=index * 0.5, ttft_s=ttft_ms / 1e3, prompt_tokens=100,
                cached_tokens=cached, engine_queue_ms=queue_ms, engine_prefill_ms=prefill_ms)


def test_columns_split_each_answered_request_in_trace_order():
    cols = columns([sent(2, 50.0, 5.0, 30.0), sent(0, 40.0, 1.0, 20.0),
                    sent(1, 99.0, None, None), sent(3, 10.0, 1.0, 1.0, status=500)])
    assert cols["index"] == [0, 1, 2]
    assert cols["ttft_ms"] == [40.0, 99.0, 50.0]
    assert cols["engine_queue_ms"] == [1.0, None, 5.0]
    assert cols["outside_ms"] == [19.0, None, 15.0]  # ttft - queue - prefill; None untimed


def test_split_takes_quantiles_over_the_timed_requests_only():
    cols = columns([sent(i, 10.0 * (i + 1), 1.0 * i, 5.0) for i in range(10)]
                   + [sent(10, 1000.0, None, None)])
    parts = split(cols)
    assert parts["requests"] == 11 and parts["timed_requests"] == 10
    assert parts["ttft_ms"] == {"p50": 60.0, "p90": 100.0}
    assert parts["engine_queue_ms"] == {"p50": 5.0, "p90": 9.0}
    assert parts["outside_ms"]["p50"] == 50.0  # 60 - 5 - 5


def test_paired_differences_are_per_request_and_by_more_cached_requests():
    mine = columns([sent(0, 50.0, 10.0, 20.0, cached=64), sent(1, 30.0, 0.0, 20.0),
                    sent(2, 80.0, 5.0, 60.0, cached=32)])
    theirs = columns([sent(0, 40.0, 0.0, 30.0), sent(1, 25.0, 0.0, 20.0),
                      sent(3, 1.0, 0.0, 0.0)])
    out = paired(mine, theirs)
    assert out["requests"] == 2 and out["more_cached_requests"] == 1  # index 2, 3 unpaired
    assert out["median_delta_ms"] == {"ttft_ms": 7.5, "engine_queue_ms": 5.0,
                                      "engine_prefill_ms": -5.0, "outside_ms": 7.5}
    assert out["more_cached"] == {"ttft_ms": 10.0, "engine_queue_ms": 10.0,
                                  "engine_prefill_ms": -10.0, "outside_ms": 10.0}
    assert paired(mine, columns([]))["median_delta_ms"]["ttft_ms"] is None


def test_report_fields_pair_raykv_with_every_other_set_up_per_round():
    rounds = {"raykv": [columns([sent(0, 50.0, 10.0, 20.0)])],
              "kv-aware": [columns([sent(0, 40.0, 0.0, 30.0)])],
              "prefix": [columns([sent(0, 45.0, 0.0, 30.0)])]}
    fields = report_fields(rounds)
    assert set(fields["ttft_split"]) == {"raykv", "kv-aware", "prefix"}
    assert set(fields["ttft_split_paired"]) == {"raykv_vs_kv-aware", "raykv_vs_prefix"}
    assert fields["ttft_split_paired"]["raykv_vs_kv-aware"][0]["median_delta_ms"]["ttft_ms"] \
        == 10.0
