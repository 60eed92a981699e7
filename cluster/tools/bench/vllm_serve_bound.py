"""The TTFT that no cache and no router could beat on a baseline's own engines, for
`raykv bench vllm-serve` (ratios with no goal, beside the goals they bound).

Per request of a baseline's round (kv-aware's, the prefix router's):

    bound TTFT = its measured TTFT
               - (reusable tokens it did not have cached) x its engines' prefill ms per token

"Reusable": the request's leading full blocks that an earlier request of the round sent,
what one cache that never evicts would hold (vllm_serve_trace.reusable_blocks_per_request),
at most all but the prompt's last token (vLLM prefills at least one). The prefill ms per
token is the baseline's own, fitted by least squares over its round's requests (engine
prefill ms against the tokens each prefilled).

So the bound gives every request every reusable token for free (no fetch, no routing cost)
and keeps the rest of what it met: its time outside the engine (HTTP, the proxy, Serve: the
same path for every set-up) and its queue (near zero in this benchmark). The ratio of its
percentile to the baseline's is then the best a cache could reach on these engines under
this workload; a goal below it cannot be met here by any cache or router that leaves the
engines' compute and the serving path as they are.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from cluster.tools.bench.harness import Report

# ratio -> (the baseline set-up, the TTFT percentile)
BOUNDS = {"ttft_p50_bound_vs_kv_aware": ("kv-aware", 50),
          "ttft_p99_bound_vs_kv_aware": ("kv-aware", 99),
          "ttft_p50_bound_vs_prefix_router": ("prefix", 50)}


def prefill_ms_per_token(records: dict) -> float:
    """The least-squares slope of engine prefill ms against the tokens prefilled, over the
    requests that have both (0 with fewer than two distinct token counts)."""
    pairs = [(prompt - cached, prefill) for prompt, cached, prefill in zip(
        records["prompt_tokens"], records["cached_tokens"], records["engine_prefill_ms"],
        strict=True) if prefill is not None]
    if len({tokens for tokens, _ in pairs}) < 2:
        return 0.0
    tokens, prefill = np.array(pairs, dtype=float).T
    return max(0.0, float(np.polyfit(tokens, prefill, 1)[0]))


def bound_ttft_ms(records: dict, reusable: Sequence[int]) -> list[float]:
    """Each answered request's bound TTFT (module docstring); `records`: a round's requests
    as the report keeps them (index into the round's trace, prompt and cached tokens, TTFT,
    engine prefill)."""
    ms_per_token = prefill_ms_per_token(records)
    bounds = []
    for index, prompt, cached, ttft in zip(records["index"], records["prompt_tokens"],
                                           records["cached_tokens"], records["ttft_ms"],
                                           strict=True):
        missed = max(0, min(reusable[index], prompt - 1) - cached)
        bounds.append(ttft - missed * ms_per_token)
    return bounds


def fill_ttft_bounds(report: Report, requests: dict[str, list[dict]],
                     reusable: list[list[int]]) -> None:
    """BOUNDS' ratios, each the median over rounds of the bound's percentile over the
    baseline's; `requests`: per set-up, each round's records (report["requests"]);
    `reusable`: per round, each request's reusable tokens (in the round trace's order)."""
    for name, (setup, percent) in BOUNDS.items():
        rounds = requests.get(setup) or []
        if not rounds:
            report.not_exercised(name, f"{setup} was not among this run's set-ups")
            continue
        if not all(records["ttft_ms"] for records in rounds):
            report.not_exercised(name, f"{setup} answered no request in some round")
            continue
        per_round = []
        for records, round_reusable in zip(rounds, reusable, strict=True):
            measured = np.percentile(records["ttft_ms"], percent)
            per_round.append(float(np.percentile(bound_ttft_ms(records, round_reusable),
                                                 percent) / measured))
        report.ratio(name, statistics.median(per_round), per_round)
