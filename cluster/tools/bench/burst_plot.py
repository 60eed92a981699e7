"""`raykv bench burst`'s timelines and chart: per second, the request rate, the hit ratio, the
p99 fetch latency and each model's memory, rebalancing off and on; one row of panels per part.

Memory per model comes from the node actors' stats()["models"] ({model: bytes}) when they
report it; until then from their per-tier byte totals, labelled as all models together.
"""

from __future__ import annotations

import math
from collections import Counter

MODES = {"off": ("tab:red", "rebalancing off"), "on": ("tab:blue", "rebalancing on")}


def _memory(samples: list[tuple[float, str, dict]], num_bins: int, bin_s: float
            ) -> tuple[str, dict[str, list[float]]]:
    """("models" or "tiers", label -> bytes summed over nodes per bin). Each node counts with
    its last sample in or before the bin (a sample the loaded machine skipped is not a 0)."""
    last: dict[tuple[int, str], dict] = {}
    for t_s, node_id, stats in samples:
        if 0 <= t_s < num_bins * bin_s:
            last[(int(t_s // bin_s), node_id)] = stats
    source = "models" if any("models" in s for s in last.values()) else "tiers"
    series: dict[str, list[float]] = {}
    for node_id in sorted({node for _, node in last}):
        stats = None
        for index in range(num_bins):
            stats = last.get((index, node_id), stats)
            for label, num_bytes in (_parts(stats, source) if stats else {}).items():
                series.setdefault(label, [0.0] * num_bins)[index] += num_bytes
    return source, series


def _parts(stats: dict, source: str) -> dict[str, int]:
    if source == "models":
        return dict(stats.get("models", {}))
    used = stats["bytes"]
    return {"all models, device+host": used["device"] + used["host"],
            "all models, disk": used["disk"]}


def timeline(outcomes: list, samples: list, duration_s: float, bin_s: float = 1.0) -> dict:
    """Per-second figures of one replay."""
    import numpy as np

    num_bins = max(1, math.ceil(duration_s / bin_s))
    fetch_ms: list[list[float]] = [[] for _ in range(num_bins)]
    cached, prefix = [0] * num_bins, [0] * num_bins
    for outcome in outcomes:
        index = min(num_bins - 1, int(outcome.arrival_s // bin_s))
        fetch_ms[index].append(outcome.fetch_s * 1e3)
        cached[index] += outcome.cached_tokens
        prefix[index] += outcome.prefix_tokens
    source, memory = _memory(samples, num_bins, bin_s)
    return {"time_s": [i * bin_s for i in range(num_bins)],
            "rate_per_s": [len(f) / bin_s for f in fetch_ms],
            "hit_ratio": [c / p if p else None for c, p in zip(cached, prefix, strict=True)],
            "fetch_p99_ms": [float(np.percentile(f, 99)) if f else None for f in fetch_ms],
            "memory_source": source, "memory_bytes": memory}


def event_counts(events: list[dict]) -> dict[str, int]:
    return dict(Counter(event["kind"] for event in events))


def _series(axis, times: list[float], values: list, **style) -> None:
    points = [(t, v) for t, v in zip(times, values, strict=True) if v is not None]
    if points:
        axis.plot(*zip(*points, strict=True), **style)


def plot_rebalance(part: dict, axes) -> None:
    """Four panels: request rate, hit ratio, p99 fetch latency, memory per model."""
    rate, hits, p99, memory = axes
    for mode, line in part["timelines"].items():
        color, label = MODES[mode]
        times = line["time_s"]
        if mode == "off":
            rate.bar(times, line["rate_per_s"], width=0.9, color="gray", align="edge")
        _series(hits, times, line["hit_ratio"], color=color, label=label)
        _series(p99, times, line["fetch_p99_ms"], color=color, label=label)
        for index, (name, values) in enumerate(sorted(line["memory_bytes"].items())):
            memory.plot(times, [v / 2**20 for v in values], color=color,
                        linestyle=("-", "--", ":", "-.")[index % 4], label=f"{name} ({mode})")
    rate.set_title("requests per second (the trace)")
    hits.set_title("hit ratio (cached / prefix tokens)")
    hits.set_ylim(0, 1.05)
    p99.set_title("p99 fetch latency per second (ms)")
    p99.set_yscale("log")
    source = next(iter(part["timelines"].values()))["memory_source"]
    memory.set_title("memory per model (MiB)" if source == "models"
                     else "memory (MiB): all models together\n(no per-model stats yet)")
    for axis in (hits, p99, memory):
        axis.legend(fontsize=7)
    for axis in axes:
        axis.set_xlabel("time (s)")


def plot_parts(parts: dict[str, dict], plotters: dict, path: str) -> None:
    """One row of panels per part that has a plotter; written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, *plotters[name]) for name in parts if name in plotters]
    width = max(num_panels for _, _, num_panels in rows)
    fig, grid = plt.subplots(len(rows), width, figsize=(4.5 * width, 3.8 * len(rows)),
                             squeeze=False)
    for row, (name, plot, num_panels) in zip(grid, rows, strict=True):
        plot(parts[name], list(row[:num_panels]))
        for axis in row[num_panels:]:
            axis.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
