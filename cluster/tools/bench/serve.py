"""`raykv bench serve`: the same chat trace against the Serve app three times in one run, once
per request router: raykv's KV-aware router, Serve's power-of-two choices, and Ray Serve LLM's
PrefixCacheAffinityRouter (a character prefix tree that never sees evictions).

Set-up: 3 simulated nodes, one engine replica each (small-llama, random weights), raykv with
small per-node tiers so that pages are evicted. Each router starts from an empty cache and a
fresh Serve instance. The trace: several tenants' system prompts with Zipf popularity,
multi-turn sessions, streamed over HTTP; TTFT is measured by the client, to the first token.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from cluster.core.config import MiB
from cluster.tools.bench import common
from cluster.tools.redis_server import free_port
from cluster.tools.simcluster import deploy, simulated_cluster, start_serve
from cluster.tools.workload import Replay, TraceShape, make_trace, summarize

MODEL = "small-llama"
ROUTERS = ("raykv", "pow2", "prefix")
NUM_NODES = 3
CONCURRENCY = 4
SHAPE = TraceShape(num_tenants=6, num_sessions=40, turns_per_session=3, system_chars=1200,
                   user_chars=120, max_tokens=8)
QUICK_SHAPE = TraceShape(num_tenants=4, num_sessions=10, turns_per_session=2, system_chars=800,
                         user_chars=80, max_tokens=4)
GOALS = {"ttft_p50_vs_prefix_router": {"max": 1.0}, "ttft_p99_vs_prefix_router": {"max": 0.7},
         "ttft_p50_vs_pow2": {"max": 0.8}, "cached_tokens_vs_prefix_router": {"min": 1.0},
         "max_replica_share": {"max": 0.5}}
NOTES = ("TTFT measured by the HTTP client to the first streamed token; p50/p99 over every "
         "request of the trace; cached tokens = usage.prompt_tokens_details.cached_tokens "
         "summed; max_replica_share = the busiest replica's share of raykv-routed requests.")


def cache_config(disk_dir: str):
    from cluster import CacheConfig

    # small-llama: 4 KiB of KV per token; a few system prompts fit on a node, not all.
    return CacheConfig(page_tokens=64, device_bytes=0, host_bytes=12 * MiB,
                       disk_bytes=16 * MiB, disk_dir=disk_dir, disk_codec="none")


def app_args(router: str) -> dict:
    return {"model": MODEL, "router": router, "engine_num_cpus": 0, "max_ongoing_requests": 2,
            "max_queued_requests": -1, "max_context_tokens": 8192}


def warm_up(url: str) -> None:
    """A few unrelated requests: every replica's first forwards pay one-off costs."""
    warm = make_trace(TraceShape(num_tenants=1, num_sessions=6, turns_per_session=1,
                                 system_chars=200, user_chars=20, max_tokens=2, seed=99))
    for session in warm:
        session.system = f"warm-up {id(session)} " + session.system  # never a trace prefix
    Replay(url, MODEL, concurrency=3).run(warm)


def run_router(router: str, trace: list, steps) -> dict:
    """A fresh cache and Serve instance, the app with `router`, the trace replayed."""
    from ray import serve

    from cluster import start, stop

    disk_dir = tempfile.mkdtemp(prefix=f"raykv-bench-serve-{router}-", dir="/tmp")
    try:
        stop()
        start(cache_config(disk_dir))
        url = start_serve(free_port())
        steps(f"{router}: deploy")
        deploy(app_args(router))
        warm_up(url)
        steps(f"{router}: replay")
        records = Replay(url, MODEL, concurrency=CONCURRENCY).run(trace)
        return {"summary": summarize(records),
                "ttft_ms": sorted(r.ttft_s * 1e3 for r in records if r.status == 200)}
    finally:
        serve.shutdown()
        shutil.rmtree(disk_dir, ignore_errors=True)


def ratios_of(per_router: dict) -> dict[str, float]:
    s = {router: figures["summary"] for router, figures in per_router.items()}
    return {"ttft_p50_vs_prefix_router": s["raykv"]["ttft_p50_ms"] / s["prefix"]["ttft_p50_ms"],
            "ttft_p99_vs_prefix_router": s["raykv"]["ttft_p99_ms"] / s["prefix"]["ttft_p99_ms"],
            "ttft_p50_vs_pow2": s["raykv"]["ttft_p50_ms"] / s["pow2"]["ttft_p50_ms"],
            "cached_tokens_vs_prefix_router":
                s["raykv"]["cached_tokens"] / max(1, s["prefix"]["cached_tokens"]),
            "max_replica_share": max(s["raykv"]["replica_shares"].values(), default=1.0)}


def plot(per_router: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, shares) = plt.subplots(1, 2, figsize=(12, 4.5))
    for router, figures in per_router.items():
        ttft = figures["ttft_ms"]
        cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=router)
        values = list(figures["summary"]["replica_shares"].values())
        shares.bar([f"{router}\n{i}" for i in range(len(values))], values)
    cdf.set_xscale("log")
    cdf.set_xlabel("time to first token (ms, log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT by router, same trace")
    cdf.legend()
    shares.axhline(1 / NUM_NODES, color="gray", linestyle="--", linewidth=1)
    shares.set_ylabel("share of requests")
    shares.set_title("requests per replica")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(per_router: dict) -> None:
    rows = [[router, str(s["requests"]), str(s["errors"]), f"{s['ttft_p50_ms']:.0f}",
             f"{s['ttft_p99_ms']:.0f}", f"{s['cached_ratio']:.2f}",
             " ".join(f"{v:.2f}" for v in s["replica_shares"].values())]
            for router, s in ((r, f["summary"]) for r, f in per_router.items())]
    common.print_tables([common.table(
        "the same trace, three routers",
        ["router", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "cached/prompt",
         "replica shares"], rows)])


def run(json_path: str | None, quick: bool, plot_path: str | None = None) -> dict:
    from rich.progress import Progress

    shape = QUICK_SHAPE if quick else SHAPE
    trace = make_trace(shape)
    per_router: dict[str, dict] = {}
    with simulated_cluster(NUM_NODES), Progress() as progress:
        steps = common.Steps(progress, "serve", 2 * len(ROUTERS))
        for router in ROUTERS:
            per_router[router] = run_router(router, trace, steps)
    report(per_router)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(per_router, plot_path)
    result = {"benchmark": "serve", "unit": "ms",
              "config": {"model": MODEL, "nodes": NUM_NODES, "concurrency": CONCURRENCY,
                         "trace": shape.__dict__ if hasattr(shape, "__dict__") else
                         {f: getattr(shape, f) for f in shape.__slots__}, "quick": quick},
              "machine": common.machine_info(),
              "per_router": {r: f["summary"] for r, f in per_router.items()},
              "ttft_ms": {r: f["ttft_ms"] for r, f in per_router.items()},
              "ratios": ratios_of(per_router), "goals": GOALS, "notes": NOTES}
    return common.finish(result, json_path)
