"""`raykv sim --plot`: one row per part that ran.

    eviction  hit ratio against capacity, one line per policy, Belady and the unlimited cache
    routing   TTFT p50 and p99 per router (bars), each router's hit ratio in its label
    scale     TTFT p50 / p99 and hit ratio against the number of nodes; shard imbalance
    fig10     local against global hit ratios per eviction policy, the paper's beside them;
              left raykv's token hit ratio, right the mean of the per-request ratios
"""

from __future__ import annotations


def plot(result: dict, png_path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [part for part in ("eviction", "routing", "scale", "fig10") if part in result]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 4.5 * len(rows)), squeeze=False)
    for row, part in zip(axes, rows, strict=True):
        {"eviction": _eviction, "routing": _routing, "scale": _scale,
         "fig10": _fig10}[part](row, result[part])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _eviction(row, eviction: dict) -> None:
    axis = row[0]
    capacities = eviction["capacity_blocks"]
    for name, ratios in eviction["hit_ratio"].items():
        if name == "raykv":
            continue  # drawn under its policy's own name
        label = f"{name} (raykv default)" if name == eviction["default_policy"] else name
        style = {"color": "black", "linestyle": "--"} if name == "belady" else {}
        axis.plot(capacities, [100 * r for r in ratios], marker="o", label=label, **style)
    if "oracle_dead_first_lru" in eviction:
        axis.plot(capacities, [100 * r for r in eviction["oracle_dead_first_lru"]],
                  color="grey", linestyle="--", marker="x",
                  label="oracle: dead pages first, else LRU")
    axis.axhline(100 * eviction["unlimited_hit_ratio"], color="grey", linewidth=0.8,
                 linestyle=":", label="unlimited capacity")
    axis.set_xscale("log")
    axis.set_xlabel("capacity (512-token blocks)")
    axis.set_ylabel("hit ratio (% of input tokens)")
    axis.set_title("eviction: one global cache")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    row[1].axis("off")


def _routing(row, routing: dict) -> None:
    routers = routing["routers"]
    names = list(routers)
    positions = range(len(names))
    floor = routing.get("global_bound", {})
    for axis, key, label in ((row[0], "ttft_p50_s", "TTFT p50 (s)"),
                             (row[1], "ttft_p99_s", "TTFT p99 (s)")):
        if f"ttft_floor_{key[5:]}" in floor:
            axis.axhline(floor[f"ttft_floor_{key[5:]}"], color="black", linestyle="--",
                         linewidth=0.8, label="floor: global cache, no queue, free fetch")
            axis.legend(fontsize=7)
        axis.bar(positions, [routers[n][key] for n in names],
                 color=["tab:red" if n == "raykv" else "tab:blue" for n in names])
        axis.set_xticks(list(positions))
        axis.set_xticklabels([f"{n}\nhit {100 * routers[n]['hit_ratio']:.1f}%" for n in names],
                             fontsize=7)
        axis.set_ylabel(label)
        axis.set_title(f"routing: {routing['num_nodes']} nodes, {routing['profile']} "
                       f"(global bound hit {100 * routing['global_bound_hit_ratio']:.1f}%)",
                       fontsize=9)
        axis.grid(True, axis="y", alpha=0.3)


def _scale(row, scale: dict) -> None:
    per = scale["per_nodes"]
    nodes = [int(n) for n in per]
    figures = list(per.values())
    windowed = [n for n, f in per.items() if f.get("window_s") is not None]
    note = (f"; N >= {min(int(n) for n in windowed)}: the first {scale['window_s']:g} s only"
            if windowed else "")
    axis = row[0]
    axis.plot(nodes, [f["ttft_p50_s"] for f in figures], marker="o", label="TTFT p50")
    axis.plot(nodes, [f["ttft_p99_s"] for f in figures], marker="o", label="TTFT p99")
    axis.set_xscale("log")
    axis.set_xlabel("nodes")
    axis.set_ylabel("seconds")
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    axis.set_title(f"scale: raykv, constant load per node{note}", fontsize=9)
    axis = row[1]
    axis.plot(nodes, [f["hit_ratio"] for f in figures], marker="^", label="hit ratio")
    axis.plot(nodes, [f["directory"]["shard_imbalance"] for f in figures], marker="o",
              label="shard imbalance (max / mean)")
    axis.plot(nodes, [f["speed_vs_realtime"] / 100 for f in figures], marker="s",
              label="simulator speed / 100x real time")
    axis.axhline(1.2, color="grey", linestyle=":", linewidth=0.8)
    axis.axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xlabel("nodes")
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    axis.set_title(f"scale{note}", fontsize=9)


def _fig10(row, fig10: dict) -> None:
    paper = fig10["paper"]
    for axis, key, what in ((row[0], "hit_ratio", "hit tokens / input tokens"),
                            (row[1], "request_hit_ratio_mean", "mean of per-request ratios")):
        labels, values = [], []
        for eviction, runs in fig10["policies"].items():
            for router, figures in runs["local"].items():
                labels.append(f"local {router}\n{eviction}")
                values.append(figures[key])
            for router, figures in runs["global"].items():
                labels.append(f"global {router}\n{eviction}")
                values.append(figures[key])
            labels.append(f"pooled\n{eviction}")
            values.append(runs["pooled"][key])
        axis.bar(range(len(values)), [100 * v for v in values],
                 color=["tab:red" if "global" in n else "tab:blue" if "local" in n else "grey"
                        for n in labels])
        for name, color in (("local_hit_ratio", "tab:blue"), ("global_hit_ratio", "tab:red")):
            axis.axhline(100 * paper[name], color=color, linestyle="--", linewidth=0.8,
                         label=f"paper, {name.split('_')[0]}: {100 * paper[name]:.1f}%")
        axis.set_xticks(list(range(len(labels))))
        axis.set_xticklabels(labels, fontsize=6, rotation=30, ha="right")
        axis.set_ylabel(f"hit ratio (%): {what}")
        axis.set_title(f"fig10: {fig10['num_nodes']} nodes x {fig10['blocks_per_node']} "
                       "blocks of DRAM", fontsize=9)
        axis.legend(fontsize=7)
        axis.grid(True, axis="y", alpha=0.3)
