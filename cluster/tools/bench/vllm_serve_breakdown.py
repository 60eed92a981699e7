"""Where each request's TTFT goes in `raykv bench vllm-serve` (pure: no Ray, no vLLM).

Every set-up's engines reply with vLLM's own per-request timings (`enable_per_request_metrics`),
so one client TTFT splits into:

    engine_queue_ms    queued in the engine core to first scheduled: waiting for a step, and
                       for RaykvConnector's load of raykv's pages (vLLM schedules a loading
                       request only once its load is done)
    engine_prefill_ms  first scheduled to the first token: the prefill's engine steps
    outside_ms         the rest: the client's HTTP, HAProxy, Serve's proxy, the ingress and
                       its router's decision, the engine's frontend, and the reply's way back

Each round keeps every request's split by its index in the round's trace (`columns`), so that
two set-ups replaying the same round pair request by request (`paired`): the medians of the
per-request differences say which part of the TTFT one set-up spends more on, on the same
prompts, beside each set-up's own medians (`split`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

TTFT_PARTS = ("ttft_ms", "engine_queue_ms", "engine_prefill_ms", "outside_ms")


def columns(sent: Sequence) -> dict[str, list]:
    """Every answered request's split, column by column, in the round's trace order (`sent`:
    trace.Sent). A part the engine did not time is None, and so is outside_ms then."""
    ok = sorted((s for s in sent if s.status == 200), key=lambda s: s.index)
    out: dict[str, list] = {"index": [], "sent_at_s": [], "prompt_tokens": [],
                            "cached_tokens": [], **{part: [] for part in TTFT_PARTS}}
    for s in ok:
        ttft_ms = s.ttft_s * 1e3
        timed = s.engine_queue_ms is not None and s.engine_prefill_ms is not None
        outside_ms = ttft_ms - s.engine_queue_ms - s.engine_prefill_ms if timed else None
        row = {"index": s.index, "sent_at_s": round(s.sent_at_s, 4),
               "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
               "ttft_ms": ttft_ms, "engine_queue_ms": s.engine_queue_ms,
               "engine_prefill_ms": s.engine_prefill_ms, "outside_ms": outside_ms}
        for name, value in row.items():
            out[name].append(round(value, 2) if isinstance(value, float) else value)
    return out


def split(cols: dict[str, list]) -> dict:
    """Per part, the p50 and p90 over the requests the engine timed (ms), and how many."""
    timed = [i for i, q in enumerate(cols["engine_queue_ms"]) if q is not None
             and cols["engine_prefill_ms"][i] is not None]
    out: dict = {"timed_requests": len(timed), "requests": len(cols["index"])}
    for part in TTFT_PARTS:
        values = sorted(cols[part][i] for i in timed)
        out[part] = {"p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9)}
    return out


def paired(cols: dict[str, list], other: dict[str, list]) -> dict:
    """Request by request (the same index in both), this set-up's part minus the other's:
    the median difference per part (ms), over the requests both answered and timed; and the
    same over the requests this set-up served more cached tokens of (`more_cached`)."""
    mine, theirs = _timed_rows(cols), _timed_rows(other)
    common = sorted(set(mine) & set(theirs))
    more = [i for i in common if mine[i]["cached_tokens"] > theirs[i]["cached_tokens"]]
    return {"requests": len(common), "more_cached_requests": len(more),
            "median_delta_ms": _deltas(mine, theirs, common),
            "more_cached": _deltas(mine, theirs, more)}


def _timed_rows(cols: dict[str, list]) -> dict[int, dict]:
    rows = {}
    for i, index in enumerate(cols["index"]):
        row = {name: values[i] for name, values in cols.items()}
        if row["engine_queue_ms"] is not None and row["engine_prefill_ms"] is not None:
            rows[index] = row
    return rows


def _deltas(mine: dict[int, dict], theirs: dict[int, dict], indices: list[int]) -> dict:
    if not indices:
        return {part: None for part in TTFT_PARTS}
    return {part: round(statistics.median(mine[i][part] - theirs[i][part] for i in indices), 2)
            for part in TTFT_PARTS}


def _quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank), None when there are none."""
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def report_fields(requests: dict[str, list[dict]], against: str = "raykv") -> dict:
    """The bench JSON's fields from every set-up's per-round columns (`requests`: set-up ->
    one `columns` per round): each set-up's split per round, and `against`'s pairing with
    every other set-up per round."""
    out: dict = {"ttft_split": {name: [split(c) for c in rounds]
                                for name, rounds in requests.items()}}
    mine = requests.get(against, [])
    out["ttft_split_paired"] = {
        f"{against}_vs_{name}": [paired(a, b) for a, b in zip(mine, rounds, strict=False)]
        for name, rounds in requests.items() if name != against and mine}
    return out
