"""`raykv bench burst`: the cache under traffic bursts, on 3 simulated nodes, in parts.

Part "rebalance": one spiky trace (cluster/tools/traces.py: Poisson arrivals, ramped 10x
spikes on warm prefixes, Zipf prefixes, two models, two tenants, a router's home-or-overflow
placement) replayed open loop through the client (cluster/tools/replay.py: a replica actor
per node, each a bounded engine stand-in), with the control loop on and with it off, each
from a fresh service; in rounds that alternate which goes first. Per request: the fetch
latency (aget) and the tokens of the prefix that came from the cache.

    p99_improvement   p99 fetch latency off / on, requests of all rounds pooled   goal >= 2
    hit_ratio_delta   cached prefix tokens / prefix tokens, on - off            goal >= -0.02

Parts are a registry (PARTS): each returns its figures, ratios, goals and notes and draws its
row of panels; run() merges their ratios and goals into one result.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.core.config import MiB
from cluster.tools.bench import burst_plot, common, elastic
from cluster.tools.replay import Outcome, ReplaySettings, replay_client
from cluster.tools.simcluster import simulated_cluster
from cluster.tools.traces import TraceShape, make_trace

NUM_NODES = 3
TENANTS = ("default", "acme")
SHAPE = TraceShape(duration_s=60.0, base_rate_per_s=5.0, first_spike_s=10.0,
                   spike_every_s=20.0, spike_s=8.0, page_tokens=128, prefix_pages=(2, 6),
                   tenants=TENANTS)
QUICK_SHAPE = TraceShape(duration_s=24.0, base_rate_per_s=5.0, first_spike_s=8.0,
                         spike_every_s=12.0, spike_s=6.0, page_tokens=128, prefix_pages=(2, 6),
                         tenants=TENANTS)
REPLAY = ReplaySettings(max_ongoing=4, prefill_s_per_token=20e-6)
ROUNDS = 3
GOALS = {"p99_improvement": {"min": 2.0}, "hit_ratio_delta": {"min": -0.02}}
NOTES = ("fetch latency = the client's aget of the prompt (directory match, local slab "
         "copies, remote exports), timed in the replica; hit ratio = cached prefix tokens / "
         "prefix tokens; remote_share = requests that fetched any page from another node "
         "(by the client's counter, approximate while requests overlap); ratios are medians "
         "of the rounds' ratios; figures pool every round of a mode; timelines are round 1's.")


def cache_config(disk_dir: str, rebalance: bool):
    from cluster import CacheConfig

    # Tight: per node and model 16 MiB of host memory and 16 MiB of disk, for prefixes of
    # 1-3 MiB (small-llama, 512 KiB pages): copies cost room that cold pages had.
    return CacheConfig(page_tokens=SHAPE.page_tokens, device_bytes=0, host_bytes=16 * MiB,
                       disk_bytes=16 * MiB, disk_dir=disk_dir, namespaces=TENANTS,
                       rebalance=rebalance)


@dataclass(frozen=True, slots=True)
class Run:
    """One replay of the trace with one setting."""

    outcomes: list[Outcome]
    samples: list[tuple[float, str, dict]]
    control: dict


def replay_once(trace: list, node_ids: list[str], rebalance: bool) -> Run:
    """A fresh service (rebalancing on or off), the trace replayed, the service stopped."""
    import ray

    from actors.handles import ControlLoopHandle
    from cluster import start

    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-burst-", dir="/tmp")
    try:
        common.stop_service()
        config = cache_config(disk_dir, rebalance)
        start(config)
        outcomes, samples = replay_client(trace, node_ids, REPLAY)
        loop = ControlLoopHandle.lookup(config)
        control = ray.get(loop.stats(), timeout=30) if loop is not None else {}
        return Run(outcomes, samples, control)
    finally:
        common.stop_service()
        shutil.rmtree(disk_dir, ignore_errors=True)


def summary(runs: list[Run]) -> dict:
    """Pooled figures of one mode's rounds."""
    import numpy as np

    outcomes = [o for run in runs for o in run.outcomes]
    fetch_ms = np.array([o.fetch_s * 1e3 for o in outcomes])
    spike_ms = np.array([o.fetch_s * 1e3 for o in outcomes if o.spike]) if any(
        o.spike for o in outcomes) else np.zeros(1)
    control = [run.control for run in runs if run.control]
    counted = ("copies", "copied_pages", "moves", "drops", "dropped_pages", "failed_actions")
    return {"requests": len(outcomes), "rounds": len(runs),
            "fetch_p50_ms": float(np.percentile(fetch_ms, 50)),
            "fetch_p90_ms": float(np.percentile(fetch_ms, 90)),
            "fetch_p99_ms": float(np.percentile(fetch_ms, 99)),
            "fetch_max_ms": float(fetch_ms.max()),
            "spike_fetch_p99_ms": float(np.percentile(spike_ms, 99)),
            "hit_ratio": sum(o.cached_tokens for o in outcomes)
            / max(1, sum(o.prefix_tokens for o in outcomes)),
            "remote_share": sum(o.remote_pages > 0 for o in outcomes) / max(1, len(outcomes)),
            "queue_wait_p99_ms": float(np.percentile(
                [(o.start_s - o.arrival_s) * 1e3 for o in outcomes], 99)),
            "control_loop": {name: sum(c.get(name, 0) for c in control) for name in counted}
            if control else None}


def round_ratios(off: dict, on: dict) -> dict[str, float]:
    return {"p99_improvement": off["fetch_p99_ms"] / on["fetch_p99_ms"],
            "hit_ratio_delta": on["hit_ratio"] - off["hit_ratio"]}


def run_rebalance(node_ids: list[str], quick: bool) -> dict:
    """The "rebalance" part: the same trace, rebalancing off and on, alternating order."""
    import statistics

    shape = QUICK_SHAPE if quick else SHAPE
    trace = make_trace(shape)
    runs: dict[str, list[Run]] = {"off": [], "on": []}
    for round_index in range(1 if quick else ROUNDS):
        order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
        for mode in order:
            runs[mode].append(replay_once(trace, node_ids, mode == "on"))
    figures = {mode: summary(mode_runs) for mode, mode_runs in runs.items()}
    rounds = [{mode: summary([runs[mode][i]]) for mode in runs} for i in range(len(runs["on"]))]
    per_round = [round_ratios(r["off"], r["on"]) for r in rounds]
    ratios = {name: statistics.median(r[name] for r in per_round) for name in per_round[0]}
    timelines = {mode: burst_plot.timeline(mode_runs[0].outcomes, mode_runs[0].samples,
                                           shape.duration_s) for mode, mode_runs in runs.items()}
    events = {mode: mode_runs[0].control.get("events", []) for mode, mode_runs in runs.items()}
    return {"config": {"trace": asdict(shape), "replay": asdict(REPLAY), "nodes": NUM_NODES,
                       "requests": len(trace), "spike_requests": sum(r.spike for r in trace)},
            "figures": figures, "rounds": rounds, "round_ratios": per_round,
            "timelines": timelines,
            "control_events": {m: burst_plot.event_counts(e) for m, e in events.items()},
            "ratios": ratios, "goals": GOALS, "notes": NOTES}


@dataclass(frozen=True, slots=True)
class Part:
    run: Callable[[list[str], bool], dict]  # (kv node ids, quick) -> the part's result
    plot: Callable  # (the part's result, a row of axes) -> None
    num_panels: int


PARTS: dict[str, Part] = {
    "rebalance": Part(run_rebalance, burst_plot.plot_rebalance, 4),
    "elastic": Part(elastic.burst_part, elastic.plot_part, 2),
}


def report(parts: dict[str, dict]) -> None:
    rows = []
    for name, part in parts.items():
        for mode, figures in part.get("figures", {}).items():
            if "fetch_p99_ms" not in figures:
                continue  # another part's figures: its own table, if any
            rows.append([f"{name}: {mode}", str(figures["requests"]),
                         f"{figures['fetch_p50_ms']:.1f}", f"{figures['fetch_p99_ms']:.1f}",
                         f"{figures['spike_fetch_p99_ms']:.1f}", f"{figures['hit_ratio']:.3f}",
                         f"{figures['remote_share']:.3f}"])
    common.print_tables([common.table(
        "the same spiky trace, rebalancing off and on",
        ["run", "requests", "fetch p50 ms", "fetch p99 ms", "spike p99 ms", "hit ratio",
         "remote share"], rows)])


def run(json_path: str | None, quick: bool, plot_path: str | None = None) -> dict:
    import ray

    from cluster.core.membership import kv_nodes

    machine = common.machine_info()
    with simulated_cluster(NUM_NODES):
        node_ids = sorted(kv_nodes("kv_node", ray.nodes()))
        parts = {name: part.run(node_ids, quick) for name, part in PARTS.items()}
    report(parts)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        burst_plot.plot_parts(parts, {n: (p.plot, p.num_panels) for n, p in PARTS.items()},
                              plot_path)
    ratios = {name: value for part in parts.values() for name, value in part["ratios"].items()}
    goals = {name: goal for part in parts.values() for name, goal in part["goals"].items()}
    result = {"benchmark": "burst", "unit": "ms", "config": {"quick": quick, "nodes": NUM_NODES},
              "machine": machine, "parts": parts, "ratios": ratios, "goals": goals,
              "notes": " ".join(part["notes"] for part in parts.values())}
    return common.finish(result, json_path)
