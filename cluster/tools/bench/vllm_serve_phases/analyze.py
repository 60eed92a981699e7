"""Summarize a diag/phases.py run: per set-up, per-request phases (medians, p90) and CPU."""

import json
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SUMMARY = ("requests", "errors", "ttft_p50_ms", "ttft_p99_ms", "hit_ratio", "send_late_p99_ms")

# Event kinds whose duration is only collected into a list, by the _Window field that holds it.
_DURATIONS = {"save": "saves", "put": "puts", "lookup_run": "lruns", "keys": "keys",
              "locate": "locs"}
# Event kinds kept whole, by request id, in the _Window field named here.
_BY_RID = {"load": "loads", "lookup_done": "ldone"}
_STEP_FIELDS = ("calls", "empty", "sched_s", "busy_s", "idle_s")
# The vLLM histograms whose _sum/_count deltas are printed as means.
_VLLM_METRICS = (
    "time_to_first_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "e2e_request_latency",
)


def pct(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def fmt(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return (
        f"n={len(values)} p50={pct(values, 50) * 1e3:.0f} p90={pct(values, 90) * 1e3:.0f} "
        f"max={max(values) * 1e3:.0f} mean={statistics.mean(values) * 1e3:.0f} ms"
    )


def load_events(directory):
    by_pid = {}
    for path in Path(directory).glob("*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by_pid[path.stem] = rows
    return by_pid


@dataclass
class _Window:
    """One set-up's engine-side events, those inside its wall-clock window, by kind."""

    reqs: dict = field(default_factory=dict)
    steps: defaultdict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    loads: dict = field(default_factory=dict)
    ldone: dict = field(default_factory=dict)
    saves: list = field(default_factory=list)
    puts: list = field(default_factory=list)
    lruns: list = field(default_factory=list)
    routes: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    locs: list = field(default_factory=list)


def main(out_dir, json_path=None):
    out = Path(out_dir)
    results = json.loads((out / "results.json").read_text())
    events = load_events(out / "events")
    kept = {setup: _analyze_setup(setup, res, events) for setup, res in results.items()}
    if json_path:
        Path(json_path).write_text(json.dumps(kept, separators=(",", ":")) + "\n")


def _analyze_setup(setup, res, events):
    """Print one set-up's report; return what is kept of it for the JSON."""
    w0, w1 = res["wall0"], res["wall1"]
    print(
        f"==== {setup}: "
        + json.dumps({k: res["summary"][k] for k in SUMMARY if k in res["summary"]})
    )
    print("   shares", res["summary"].get("replica_shares"))
    window = _collect(events, w0, w1)
    _annotate_requests(events, window.reqs)
    rows = _join_sends(res, w0, window.reqs)
    ph = _phases(rows)
    for name, vals in ph.items():
        print(f"   {name:52s} {fmt(vals)}")
    kept = _kept(res, ph, window)
    _print_connector(rows, window)
    _print_router(window)
    _print_system(res, window.steps, w1 - w0)
    _print_polls(events, w0, w1)
    for key, name, secs in res.get("threads", [])[:16]:
        print(f"     thread {secs:7.2f} s  {key} / {name}")
    _print_vllm_metrics(res)
    return kept


def _collect(events, w0, w1):
    """Sort the events from just before the window to well after it (30 s) by kind."""
    window = _Window()
    for pid, rows in events.items():
        for e in rows:
            t = e.get("t", 0)
            if w0 - 2 <= t <= w1 + 30:
                _take(window, pid, e, t)
    return window


def _take(window, pid, e, t):
    k = e["k"]
    if k == "add":
        window.reqs[e["rid"]] = {"pid": pid, "add": t, "arrival": e["arrival"], "n": e["n"]}
    elif k == "steps":
        for f in _STEP_FIELDS:
            window.steps[pid][f] += e[f]
    elif k == "route":
        window.routes.append(e)
    elif k in _DURATIONS:
        getattr(window, _DURATIONS[k]).append(e["dur"])
    elif k in _BY_RID:
        getattr(window, _BY_RID[k])[e["rid"]] = e


def _annotate_requests(events, reqs):
    """Add each request's connector asks, first schedule and free (any time) to it."""
    for rows in events.values():
        for e in rows:
            r = reqs.get(e.get("rid"))
            if r is None:
                continue
            if e["k"] == "gnm":
                r.setdefault("gnm0", e["t"])
                r["gnm_calls"] = r.get("gnm_calls", 0) + 1
                r["gnm_s"] = r.get("gnm_s", 0) + e["dur"]
                if e["result"] is not None and "answer" not in r:
                    r["answer"], r["matched"] = e["t"], e["result"]
            elif e["k"] == "first_sched":
                r.setdefault("sched", e["t"])
                r.setdefault("computed", e["computed"])
            elif e["k"] == "free":
                r["free"] = e["t"]


def _join_sends(res, w0, reqs):
    """Join client sends to engine requests: same prompt tokens, nearest arrival after send.

    Returns (send record, send wall time, engine request) triples, in send order.
    """
    sent = [s for s in res["sent"] if s["status"] == 200]
    free_reqs = sorted(reqs.values(), key=lambda r: r["arrival"] or 0)
    used = set()
    rows = []
    for s in sorted(sent, key=lambda s: s["sent_at_s"]):
        send = w0 + s["sent_at_s"]
        cands = [
            r
            for r in free_reqs
            if id(r) not in used
            and r["n"] == s["prompt_tokens"]
            and r["arrival"]
            and r["arrival"] >= send - 0.05
        ]
        if not cands:
            continue
        r = min(cands, key=lambda r: r["arrival"])
        used.add(id(r))
        rows.append((s, send, r))
    print(f"   joined {len(rows)} of {len(sent)} answered requests")
    return rows


def _phases(rows):
    """Each phase's durations (s), by phase name, over the joined requests."""
    ph = defaultdict(list)
    for s, send, r in rows:
        ph["client ttft"].append(s["ttft_s"])
        ph["send -> engine frontend (ingress, router, handle)"].append(r["arrival"] - send)
        ph["frontend -> engine core add"].append(r["add"] - r["arrival"])
        _connector_phases(ph, r)
        if "sched" in r and "free" in r:
            ph["first scheduled -> finished (prefill)"].append(r["free"] - r["sched"])
        if "free" in r:
            ph["engine finished -> client reply"].append(send + s["ttft_s"] - r["free"])
            ph["engine arrival -> finished"].append(r["free"] - r["arrival"])
        if r.get("answer") is not None and r.get("matched"):
            ph["  (hits) answer -> first scheduled"].append(
                r["sched"] - r["answer"] if "sched" in r else None
            )
    return ph


def _connector_phases(ph, r):
    """From engine add to first schedule, through the connector's lookup where it asked."""
    if "gnm0" in r:
        ph["add -> first connector ask"].append(r["gnm0"] - r["add"])
        if "answer" in r:
            ph["connector lookup wait (first ask -> answer)"].append(r["answer"] - r["gnm0"])
            if "sched" in r:
                ph["answer -> first scheduled (load + queue)"].append(r["sched"] - r["answer"])
    elif "sched" in r:
        ph["add -> first scheduled"].append(r["sched"] - r["add"])


def _kept(res, ph, window):
    """What the JSON keeps of one set-up."""
    routes, loads, puts = window.routes, window.loads, window.puts
    return {
        "summary": res["summary"], "cpu_s": res["cpu"], "system_busy_s": res["system_busy_s"],
        "phases_ms": {name: {"n": len([v for v in vals if v is not None]),
                             "p50": _ms(pct(vals, 50)), "p90": _ms(pct(vals, 90))}
                      for name, vals in ph.items()},
        "router": {"choose_ms_p50": _ms(pct([e["dur"] for e in routes], 50)),
                   "chosen": dict(Counter(e["chosen"] for e in routes)),
                   "estimates": [e["est"] for e in sorted(routes, key=lambda e: e["t"])
                                 if e.get("est")][:40]},
        "loads_ms_p50": _ms(pct([e["dur"] for e in loads.values()], 50)),
        "num_loads": len(loads), "num_puts": len(puts),
        "puts_ms_p50": _ms(pct(puts, 50)),
        "sent": res["sent"]}


def _print_connector(rows, window):
    gcalls = [r.get("gnm_calls", 0) for _, _, r in rows]
    if any(gcalls):
        print(
            f"   connector asks per request: p50 {pct(gcalls, 50)} max {max(gcalls)}; "
            f"time in get_num_new_matched_tokens total "
            f"{sum(r.get('gnm_s', 0) for _, _, r in rows):.2f} s"
        )
    loads, saves, puts = window.loads, window.saves, window.puts
    print(f"   lookup run (thread)   {fmt(window.lruns)}")
    print(f"   lookup submit->done   {fmt([e['total'] for e in window.ldone.values()])}")
    print(
        f"   loads                 {fmt([e['dur'] for e in loads.values()])} "
        f"tokens {sum(e['n'] for e in loads.values())}"
    )
    print(f"   save (gather, step)   {fmt(saves)} total {sum(saves):.2f} s")
    print(f"   put (background)      {fmt(puts)} total {sum(puts):.2f} s")


def _print_router(window):
    routes = window.routes
    print(f"   router choose         {fmt([e['dur'] for e in routes])}")
    print(f"   router keys           {fmt(window.keys)}")
    print(f"   router locate         {fmt(window.locs)}")
    if routes:
        chosen = defaultdict(int)
        for e in routes:
            chosen[e["chosen"]] += 1
        print(f"   router chosen counts  {dict(chosen)}; last counters {routes[-1]['counters']}")


def _print_system(res, steps, span_s):
    """Engine steps, system busy/idle and the busiest processes' CPU."""
    for pid, st in steps.items():
        print(
            f"   engine {pid} steps: calls {st['calls']:.0f} empty {st['empty']:.0f} "
            f"sched {st['sched_s']:.2f}s busy(forward) {st['busy_s']:.2f}s "
            f"empty-step {st['idle_s']:.2f}s"
        )
    print(
        f"   system busy {res['system_busy_s']} s, idle {res['system_idle_s']} s "
        f"over {span_s:.0f} s"
    )
    for name, (secs, count) in list(res["cpu"].items())[:14]:
        print(f"     cpu {secs:7.2f} s  x{count}  {name}")


def _print_polls(events, w0, w1):
    polls = defaultdict(lambda: [0, 0])
    for pid, rows in events.items():
        for e in rows:
            if e["k"] == "errpoll" and w0 <= e["t"] <= w1:
                polls[pid][0] += e["n"]
                polls[pid][1] += e["none"]
    if polls:
        print(f"   Ray error-listener polls in the replay: {dict(polls)}")


def _metric_sums(lines):
    """Sum the _sum and _count series of the _VLLM_METRICS over their labels."""
    out = defaultdict(float)
    for line in lines:
        name = line.split("{")[0]
        if any(x in name for x in _VLLM_METRICS) and (
            name.endswith("_sum") or name.endswith("_count")
        ):
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _print_vllm_metrics(res):
    """vLLM's own means over the replay: the metrics' deltas, after minus before."""
    b, a = _metric_sums(res["metrics_before"]), _metric_sums(res["metrics_after"])
    for name in sorted(a):
        if name.endswith("_sum"):
            cnt = a[name[:-4] + "_count"] - b.get(name[:-4] + "_count", 0)
            if cnt:
                print(
                    f"   vllm {name[:-4]}: mean "
                    f"{(a[name] - b.get(name, 0)) / cnt * 1e3:.0f} ms over {cnt:.0f}"
                )


def _ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
