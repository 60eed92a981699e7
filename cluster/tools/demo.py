"""`raykv demo`: the Serve app on raykv, on a simulated 3-node cluster, under a chat workload.

    3 simulated nodes (one raylet each), raykv on each (device, host and disk tiers)
    Serve: an OpenAI-compatible ingress, and one engine replica per node (small-llama,
    random weights), routed by raykv's KV-aware router

The workload, over HTTP: several tenants (each its own namespace, so their pages never mix),
each with a system prompt its users share, multi-turn chats, half of them streamed. It runs
twice: once as is, and once with every request made uncachable (a unique first line), which is
the recompute baseline. It prints what the cache did and writes a PNG.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from pathlib import Path

from cluster.core.config import MiB
from cluster.tools.redis_server import free_port
from cluster.tools.simcluster import deploy, simulated_cluster, start_serve
from cluster.tools.workload import Replay, TraceShape, make_trace, summarize

MODEL = "small-llama"
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
SHAPE = TraceShape(num_tenants=3, num_sessions=18, turns_per_session=3, system_chars=1000,
                   user_chars=100, max_tokens=12, zipf_s=0.8, stream_fraction=0.5, seed=7)
CONCURRENCY = 3


def cache_config(disk_dir: str):
    from cluster import CacheConfig

    # small-llama keeps 4 KiB of KV per token: small tiers, so all three are used.
    return CacheConfig(page_tokens=64, device_bytes=4 * MiB, host_bytes=8 * MiB,
                       disk_bytes=64 * MiB, disk_dir=disk_dir, disk_codec="none",
                       namespaces=("default", *TENANTS))


def _uncachable(session_index: int, turn: int) -> str:
    return f"[request {session_index}.{turn}] "


def _node_hits() -> dict[str, int]:
    import ray

    from actors.handles import NodeHandle
    from cluster.api import running_config
    from cluster.core.membership import kv_nodes

    config = running_config()
    totals = {"device": 0, "host": 0, "disk": 0}
    for node_id in kv_nodes(config.node_resource, ray.nodes()):
        handle = NodeHandle.lookup(node_id, config)
        stats = ray.get(handle.stats(), timeout=30) if handle else {}
        for tier in totals:
            totals[tier] += stats.get(f"hits_{tier}", 0)
    return totals


def _engine_stats() -> list[dict]:
    from ray import serve

    handle = serve.get_deployment_handle("EngineDeployment", app_name="raykv")
    # Several calls, so each replica is likely asked; de-duplicated by replica name.
    replies = [handle.drain.remote() for _ in range(12)]
    return list({r["replica"]: r for r in (reply.result() for reply in replies)}.values())


def tenant_keys() -> dict[str, str]:
    """A fresh API key per tenant (namespace -> key): the app serves tenants only with keys."""
    return {tenant: secrets.token_urlsafe(24) for tenant in TENANTS}


def run_workload(url: str, console, keys: dict[str, str]) -> dict:
    from rich.progress import Progress

    trace = make_trace(SHAPE, TENANTS)
    total = sum(len(s.users) for s in trace)
    with Progress(console=console) as progress:
        task = progress.add_task("chats with the cache", total=total)
        cached = Replay(url, MODEL, CONCURRENCY, bearer_keys=keys).run(
            trace, on_record=lambda _: progress.advance(task))
        hits = _node_hits()
        engines = _engine_stats()
        task = progress.add_task("the same chats, uncachable (recompute)", total=total)
        recompute = Replay(url, MODEL, CONCURRENCY, prefix=_uncachable, bearer_keys=keys).run(
            trace, on_record=lambda _: progress.advance(task))
    remote_pages = sum(c.get("remote_pages", 0) for e in engines
                       for c in e.get("clients", {}).values())
    summary = summarize(cached)
    return {"cached": summary, "recompute": summarize(recompute), "hits": hits,
            "remote_pages": remote_pages, "engines": engines,
            "node_shares": _node_shares(summary["replica_shares"]),
            "records": {"cached": cached, "recompute": recompute}}


def _node_shares(replica_shares: dict[str, float]) -> dict[str, float]:
    """Each kv node's share of requests (replicas are named node8/replica8), 0 for a node
    whose replica got none."""
    import ray

    nodes = {n["NodeID"][:8]: 0.0 for n in ray.nodes() if n["Alive"]}
    for replica, share in replica_shares.items():
        node = replica.split("/")[0]
        nodes[node] = nodes.get(node, 0.0) + share
    return nodes


def show_operations(console) -> None:
    """What an operator sees of this running service: `raykv status`, and the metrics Ray's
    Prometheus endpoints serve (Grafana's dashboard is built on them)."""
    from cluster.tools.grafana import series
    from cluster.tools.ops_cli import status_command
    from cluster.tools.simcluster import scrape_metric

    console.rule("raykv status (of the running demo)")
    status_command(address=None, as_json=False)
    time.sleep(2.5)  # one metrics report period
    hits = scrape_metric(series("raykv_hits"), "tier")
    moved = scrape_metric(series("raykv_bytes_moved"), "path")
    console.print("Prometheus (Ray's endpoints): "
                  + ", ".join(f"{series('raykv_hits')}{{tier={t}}} = {hits[t]:.0f}"
                              for t in sorted(hits))
                  + "; bytes moved: " + ", ".join(f"{p} {v / 2**20:.1f} MiB"
                                                  for p, v in sorted(moved.items())))


def print_report(console, figures: dict) -> None:
    from rich.table import Table

    cached, recompute = figures["cached"], figures["recompute"]
    table = Table(title=f"raykv demo: {MODEL} on 3 simulated nodes, {len(TENANTS)} tenants")
    for column in ("", "requests", "errors", "cached / prompt tokens", "TTFT p50 ms",
                   "TTFT p99 ms"):
        table.add_column(column, justify="right" if column else "left")
    for name, s in (("with raykv", cached), ("recompute", recompute)):
        table.add_row(name, str(s["requests"]), str(s["errors"]),
                      f"{s['cached_tokens']} / {s['prompt_tokens']} ({s['cached_ratio']:.0%})",
                      f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}")
    console.print(table)
    hits = figures["hits"]
    tiers = Table(title="cache hits (pages) by where they were found")
    for column in ("device", "host", "disk", "of them fetched from another node"):
        tiers.add_column(column, justify="right")
    tiers.add_row(*(str(hits[t]) for t in ("device", "host", "disk")),
                  str(figures["remote_pages"]))
    console.print(tiers)
    shares = Table(title="requests per engine replica (one per node; raykv router)")
    shares.add_column("node")
    shares.add_column("share", justify="right")
    for node, share in figures["node_shares"].items():
        shares.add_row(node, f"{share:.0%}")
    console.print(shares)
    speedup = recompute["ttft_p50_ms"] / max(cached["ttft_p50_ms"], 1e-9)
    console.print(f"Cached prefixes served {cached['cached_ratio']:.0%} of prompt tokens; "
                  f"median time to first token {cached['ttft_p50_ms']:.0f} ms against "
                  f"{recompute['ttft_p50_ms']:.0f} ms recomputing ({speedup:.2f}x).")


def write_png(path: Path, figures: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, tiers, shares) = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, records in figures["records"].items():
        ttft = sorted(r.ttft_s * 1e3 for r in records if r.status == 200)
        label = "with raykv" if name == "cached" else "recompute"
        cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label)
    cdf.set_xlabel("time to first token (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT over HTTP")
    cdf.legend()
    hits = figures["hits"]
    tiers.bar(["device", "host", "disk", "remote"],
              [hits["device"], hits["host"], hits["disk"], figures["remote_pages"]],
              color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"])
    tiers.set_title("cache hits by tier (pages)")
    share = figures["node_shares"]
    shares.bar(range(len(share)), list(share.values()))
    shares.set_xticks(range(len(share)), list(share), fontsize=8)
    shares.set_title("requests per node's replica")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(png_path: Path, num_nodes: int) -> dict:
    """Start the simulated cluster, raykv and the Serve app; run the workload; report."""
    from rich.console import Console

    from cluster import start

    console = Console(width=max(Console().width, 110))
    start_s = time.perf_counter()
    disk_dir = tempfile.mkdtemp(prefix="raykv-demo-", dir="/tmp")
    try:
        with simulated_cluster(num_nodes):
            nodes = start(cache_config(disk_dir))["nodes"]
            url = start_serve(free_port())
            console.print(f"raykv on {len(nodes)} nodes; deploying the Serve app ...")
            keys = tenant_keys()
            deploy({"model": MODEL, "engine_num_cpus": 0, "max_ongoing_requests": 2,
                    "api_keys": {key: tenant for tenant, key in keys.items()}})
            console.print(f"OpenAI API at {url}/v1 ({time.perf_counter() - start_s:.0f} s)")
            figures = run_workload(url, console, keys)
            show_operations(console)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    print_report(console, figures)
    write_png(Path(png_path), figures)
    figures.pop("records")
    figures["elapsed_s"] = time.perf_counter() - start_s
    console.print(f"Chart written to {png_path}; demo took {figures['elapsed_s']:.0f} s")
    return figures
