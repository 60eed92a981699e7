"""`raykv bench burst`: the cache under traffic bursts, on 3 simulated nodes, in parts.

Part "rebalance": one spiky trace (cluster/tools/traces.py: Poisson arrivals, spikes whose
extra traffic ramps up to 10x the base rate on a few of the most popular prefixes, Zipf
prefixes, two models, two tenants, a router's home-or-overflow placement) replayed open loop
through the client (cluster/tools/replay.py: a replica actor per node, each a bounded engine
stand-in that times its aget, sleeps a stand-in prefill per uncached token and puts what was
missing), with the control loop on and with it off, each from a fresh service with tight
memory. Rounds (harness.interleave: at least 3, the order rotating) run both once each, and
every ratio is the median of the rounds' values (each round's p99 is that run's own, never
pooled over rounds), with the spread:

    p99_improvement   fetch p99 off / on                                          goal >= 2
    hit_ratio_delta   cached prefix tokens / prefix tokens, on - off              goal >= -0.02

Both are not exercised (null, and the run fails) unless the trace has spike traffic and the
control loop copied or moved pages in every "on" round.

Part "elastic": cluster/tools/bench/elastic.py's rounds and checks (elastic sharing against
the static split in proportion to working sets, idle shrink, min quota), on the same cluster.

Parts are a registry (PARTS): each writes its ratios into the run's Report and returns its
figures, and draws its row of panels.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.core.config import MiB
from cluster.tools.bench import burst_plot, common, elastic, harness
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
NOTES = ("rebalance: fetch latency = the client's aget of the prompt (directory match, local "
         "slab copies, remote reads), timed in the replica; hit ratio = cached prefix tokens / "
         "prefix tokens; remote_share = requests that fetched any page from another node "
         "(by the client's counter, approximate while requests overlap); each round replays "
         "the same trace off and on, each from a fresh service; ratios are medians of the "
         "rounds' values (a round's p99 is its own run's); actions = control-loop copies + "
         "moves; timelines are round 1's.")
EXERCISED_WHY = "no spike traffic in the trace, or the control loop copied and moved nothing " \
                "in some \"on\" round"


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


def summary(run: Run) -> dict:
    """One replay's figures."""
    import numpy as np

    outcomes = run.outcomes
    fetch_ms = np.array([o.fetch_s * 1e3 for o in outcomes])
    spike_ms = [o.fetch_s * 1e3 for o in outcomes if o.spike] or [0.0]
    counted = ("copies", "copied_pages", "moves", "drops", "dropped_pages", "failed_actions")
    return {"requests": len(outcomes),
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
            "control_loop": {name: run.control.get(name, 0) for name in counted},
            "actions": run.control.get("copies", 0) + run.control.get("moves", 0)}


def exercised(spike_requests: int, rounds: list[dict]) -> bool:
    """A burst happened and rebalancing acted (copied or moved) in every "on" round."""
    return spike_requests > 0 and all(r["on"]["actions"] > 0 for r in rounds)


def run_rebalance(node_ids: list[str], quick: bool, report: harness.Report) -> dict:
    """The "rebalance" part: the same trace, rebalancing off and on, in rotating rounds."""
    shape = QUICK_SHAPE if quick else SHAPE
    trace = make_trace(shape)
    runs: dict[str, list[Run]] = {"off": [], "on": []}

    def contender(mode: str):
        def fetch_p99_ms(round_index: int) -> float:
            runs[mode].append(replay_once(trace, node_ids, mode == "on"))
            return summary(runs[mode][-1])["fetch_p99_ms"]
        return fetch_p99_ms

    p99_ms = harness.interleave({mode: contender(mode) for mode in runs}, ROUNDS)
    rounds = [{mode: summary(runs[mode][i]) for mode in runs} for i in range(ROUNDS)]
    spike_requests = sum(r.spike for r in trace)
    if report.require("p99_improvement", exercised(spike_requests, rounds), EXERCISED_WHY):
        report.paired("p99_improvement", p99_ms["off"], p99_ms["on"])
    if report.require("hit_ratio_delta", exercised(spike_requests, rounds), EXERCISED_WHY):
        deltas = [r["on"]["hit_ratio"] - r["off"]["hit_ratio"] for r in rounds]
        report.ratio("hit_ratio_delta", statistics.median(deltas), deltas)
    timelines = {mode: burst_plot.timeline(mode_runs[0].outcomes, mode_runs[0].samples,
                                           shape.duration_s) for mode, mode_runs in runs.items()}
    events = {mode: mode_runs[0].control.get("events", []) for mode, mode_runs in runs.items()}
    return {"config": {"trace": asdict(shape), "replay": asdict(REPLAY), "nodes": NUM_NODES,
                       "requests": len(trace), "spike_requests": spike_requests},
            "rounds": rounds, "timelines": timelines,
            "control_events": {m: burst_plot.event_counts(e) for m, e in events.items()}}


@dataclass(frozen=True, slots=True)
class Part:
    # (kv node ids, quick, the run's Report) -> the part's figures; its ratios go in the Report
    run: Callable[[list[str], bool, harness.Report], dict]
    plot: Callable  # (the part's figures, a row of axes) -> None
    num_panels: int


def _elastic_part(node_ids: list[str], quick: bool, report: harness.Report) -> dict:
    return elastic.measure(report, quick)


PARTS: dict[str, Part] = {
    "rebalance": Part(run_rebalance, burst_plot.plot_rebalance, 4),
    "elastic": Part(_elastic_part, elastic.plot_part, 2),
}


def rebalance_table(part: dict):
    rows = []
    for index, modes in enumerate(part["rounds"]):
        for mode, figures in modes.items():
            rows.append([f"round {index + 1}: {mode}", str(figures["requests"]),
                         f"{figures['fetch_p50_ms']:.1f}", f"{figures['fetch_p99_ms']:.1f}",
                         f"{figures['spike_fetch_p99_ms']:.1f}", f"{figures['hit_ratio']:.4f}",
                         f"{figures['remote_share']:.3f}", str(figures["actions"])])
    return common.table("the same spiky trace, rebalancing off and on",
                        ["run", "requests", "fetch p50 ms", "fetch p99 ms", "spike p99 ms",
                         "hit ratio", "remote share", "actions"], rows)


def run(json_path: str | None, quick: bool, plot_path: str | None = None) -> dict:
    import ray

    from cluster.core.membership import kv_nodes

    report = harness.Report("burst", "ms", {"quick": quick, "nodes": NUM_NODES,
                                            "rounds": ROUNDS},
                            {**GOALS, **elastic.GOALS}, [NOTES, *elastic.notes(quick)])
    with simulated_cluster(NUM_NODES):
        node_ids = sorted(kv_nodes("kv_node", ray.nodes()))
        parts = {name: part.run(node_ids, quick, report) for name, part in PARTS.items()}
    common.print_tables([rebalance_table(parts["rebalance"]), elastic.table(parts["elastic"])])
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        burst_plot.plot_parts(parts, {n: (p.plot, p.num_panels) for n, p in PARTS.items()},
                              plot_path)
    report["parts"] = parts
    return report.finish(json_path)
