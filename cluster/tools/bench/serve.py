"""`raykv bench serve`: should a serving team put raykv under its engines, or keep what it runs
today? The same chat trace through the Serve app, four ways:

    raykv         raykv's shared cache, raykv's KV-aware router
    prefix        raykv's shared cache, Ray Serve LLM's PrefixCacheAffinityRouter
    local-pow2    each replica only its own prefix cache (as vLLM's automatic prefix caching
                  keeps one), no raykv; Serve's power-of-two choices router
    local-prefix  each replica only its own prefix cache, no raykv; PrefixCacheAffinityRouter

The two local contenders are what users run today. A replica's own cache is an LRU of whole
pages under raykv's page keys (cluster/serving/local_cache.py) holding as many bytes as raykv's
tiers on that replica's node (device + host + disk): the same memory, all of it in process.

Set-up: 3 simulated nodes, one engine replica each (small-llama, random weights). Each
contender starts from an empty cache and a fresh Serve instance, warms its replicas up, and
replays the round's trace: several tenants' system prompts with Zipf popularity, multi-turn
sessions, streamed over HTTP; TTFT is measured by the client, to the first token. Every round
is a fresh set of sessions of the same shape, and runs every contender once, in rotating order
(harness.interleave).

Ratios (harness.Report.paired: medians of per-round ratios, with their spread): raykv against
the stronger local contender of each round (the one with the lower TTFT p50 that round), and
against the prefix router on raykv's own cache; max_replica_share is raykv's busiest replica's
share of its requests. A ratio whose contenders cached nothing, or whose caches never evicted,
was not exercised: the run fails.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cluster.core.config import MiB
from cluster.tools.bench import common
from cluster.tools.bench.harness import Report, interleave
from cluster.tools.redis_server import free_port
from cluster.tools.simcluster import deploy, simulated_cluster, start_serve
from cluster.tools.workload import Replay, TraceShape, make_trace, summarize

MODEL = "small-llama"
NUM_NODES = 3
CONCURRENCY = 4
PAGE_TOKENS = 64
# name -> (router, whether each replica has only its own cache)
CONTENDERS = {"raykv": ("raykv", False), "prefix": ("prefix", False),
              "local-pow2": ("pow2", True), "local-prefix": ("prefix", True)}
LOCAL = ("local-pow2", "local-prefix")
GOALS = {"ttft_p50_vs_local_prefix": {"max": 0.8}, "ttft_p99_vs_local_prefix": {"max": 0.6},
         "cached_tokens_vs_local_prefix": {"min": 1.3},
         "ttft_p50_vs_prefix_router": {"max": 1.0}, "max_replica_share": {"max": 0.5}}


@dataclass(frozen=True, slots=True)
class Plan:
    """One run's sizes: the trace of every round, the rounds, raykv's tiers per node."""

    shape: TraceShape
    num_rounds: int
    host_bytes: int
    disk_bytes: int

    @property
    def local_cache_bytes(self) -> int:
        """A replica's own cache: everything raykv's tiers hold on its node (no device tier)."""
        return self.host_bytes + self.disk_bytes


# small-llama: 4 KiB of KV per token, so a 1200-character system prompt is ~4.7 MiB.
PLAN = Plan(TraceShape(num_tenants=6, num_sessions=40, turns_per_session=3, system_chars=1200,
                       user_chars=120, max_tokens=8), 3, 12 * MiB, 16 * MiB)
QUICK_PLAN = Plan(TraceShape(num_tenants=4, num_sessions=10, turns_per_session=2,
                             system_chars=800, user_chars=80, max_tokens=4), 3, 2 * MiB, 4 * MiB)


def plan_for(quick: bool) -> Plan:
    return QUICK_PLAN if quick else PLAN


def round_trace(plan: Plan, round_index: int) -> list:
    """Round `round_index`'s sessions: fresh tenants' prompts and sessions, the same shape."""
    return make_trace(dataclasses.replace(plan.shape, seed=1000 + round_index))


def cache_config(plan: Plan, disk_dir: str):
    from cluster import CacheConfig

    return CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=0, host_bytes=plan.host_bytes,
                       disk_bytes=plan.disk_bytes, disk_dir=disk_dir, disk_codec="none")


def app_args(name: str, plan: Plan) -> dict:
    router, own_cache = CONTENDERS[name]
    local = {"page_tokens": PAGE_TOKENS, "capacity_bytes": plan.local_cache_bytes}
    return {"model": MODEL, "router": router, "engine_num_cpus": 0, "max_ongoing_requests": 2,
            "max_queued_requests": -1, "max_context_tokens": 8192,
            "local_cache": local if own_cache else None}


def warm_up(url: str) -> None:
    """A few unrelated requests: every replica's first forwards pay one-off costs."""
    warm = make_trace(TraceShape(num_tenants=1, num_sessions=6, turns_per_session=1,
                                 system_chars=200, user_chars=20, max_tokens=2, seed=99))
    for session in warm:
        session.system = f"warm-up {id(session)} " + session.system  # never a trace prefix
    Replay(url, MODEL, concurrency=3).run(warm)


def run_contender(name: str, plan: Plan, trace: list) -> dict:
    """A fresh Serve instance (and, on raykv's cache, a fresh service) replaying `trace`:
    {"summary", "ttft_ms", "evicted_pages", "cache"}."""
    from ray import serve

    from cluster import start, stop

    disk_dir = tempfile.mkdtemp(prefix=f"raykv-bench-serve-{name}-", dir="/tmp")
    try:
        stop()
        if not CONTENDERS[name][1]:
            start(cache_config(plan, disk_dir))
        url = start_serve(free_port())
        deploy(app_args(name, plan))
        warm_up(url)
        records = Replay(url, MODEL, concurrency=CONCURRENCY).run(trace)
        cache = cache_figures(CONTENDERS[name][1])
        return {"summary": summarize(records),
                "ttft_ms": sorted(r.ttft_s * 1e3 for r in records if r.status == 200),
                "evicted_pages": evicted_pages(cache), "cache": cache}
    finally:
        serve.shutdown()
        stop()
        shutil.rmtree(disk_dir, ignore_errors=True)


def cache_figures(own_cache: bool) -> dict:
    """What the caches did during the replay, summed over the replicas that answered:
    engine.* (requests, cached tokens, failed stores), client.* (raykv clients: pages read on
    this node or another, failed calls) or local_cache.* (pages matched, stored, evicted), and
    node.* (raykv's tiers: hits per tier, pages demoted or dropped per tier)."""
    totals: dict[str, int] = {}
    for stats in _engine_stats():
        _add(totals, "engine", stats)
        if own_cache:
            _add(totals, "local_cache", stats["local_cache"])
        for counters in () if own_cache else stats["clients"].values():
            _add(totals, "client", counters)
    if not own_cache:
        from cluster.api import status

        for node in status()["nodes"]:
            _add(totals, "node", {k: v for k, v in node.items() if k.startswith("hits_")})
            _add(totals, "node.evictions", node.get("evictions", {}))
    return totals


def evicted_pages(cache: dict) -> int:
    """Pages the caches let go: the replicas' own LRUs, or raykv's tiers on every node."""
    return cache.get("local_cache.evicted_pages", 0) + sum(
        v for k, v in cache.items() if k.startswith("node.evictions."))


def _add(totals: dict[str, int], prefix: str, counters: dict) -> None:
    for name, value in counters.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            totals[f"{prefix}.{name}"] = totals.get(f"{prefix}.{name}", 0) + value


def _engine_stats() -> list[dict]:
    from ray import serve

    handle = serve.get_deployment_handle("EngineDeployment", app_name="raykv")
    # Several calls, so that each replica is asked; de-duplicated by replica name.
    replies = [handle.drain.remote() for _ in range(4 * NUM_NODES)]
    return list({r["replica"]: r for r in (reply.result() for reply in replies)}.values())


def stronger_local(rounds: dict[str, list[dict]], round_index: int) -> str:
    """The local contender with the lower TTFT p50 in that round."""
    return min(LOCAL, key=lambda name: rounds[name][round_index]["summary"]["ttft_p50_ms"])


def figures(rounds: dict[str, list[dict]], name: str, field: str) -> list[float]:
    return [float(r["summary"][field]) for r in rounds[name]]


def local_figures(rounds: dict[str, list[dict]], field: str) -> list[float]:
    """Each round's figure of that round's stronger local contender."""
    return [float(rounds[stronger_local(rounds, i)][i]["summary"][field])
            for i in range(len(rounds["raykv"]))]


def exercised(rounds: dict[str, list[dict]], names: tuple[str, ...]) -> str:
    """Why these contenders' comparison was not exercised ("" when it was): each must have
    answered and cached tokens in every round, and its caches must have evicted pages in
    some round (else memory was no limit and sharing it could not matter)."""
    for name in names:
        for index, figures_of_round in enumerate(rounds[name]):
            summary = figures_of_round["summary"]
            if not summary["ok"]:
                return f"{name} answered no request in round {index}"
            if not summary["cached_tokens"]:
                return f"{name} cached no token in round {index}"
        if not sum(r["evicted_pages"] for r in rounds[name]):
            return f"{name}'s caches evicted nothing in any round: memory was no limit"
    return ""


def fill_ratios(report: Report, rounds: dict[str, list[dict]]) -> None:
    """The five ratios, each paired per round, or not exercised."""
    why_local = exercised(rounds, ("raykv", *LOCAL))
    for ratio, field in (("ttft_p50_vs_local_prefix", "ttft_p50_ms"),
                         ("ttft_p99_vs_local_prefix", "ttft_p99_ms"),
                         ("cached_tokens_vs_local_prefix", "cached_tokens")):
        if report.require(ratio, not why_local, why_local):
            report.paired(ratio, figures(rounds, "raykv", field), local_figures(rounds, field))
    why_prefix = exercised(rounds, ("raykv", "prefix"))
    if report.require("ttft_p50_vs_prefix_router", not why_prefix, why_prefix):
        report.paired("ttft_p50_vs_prefix_router", figures(rounds, "raykv", "ttft_p50_ms"),
                      figures(rounds, "prefix", "ttft_p50_ms"))
    shares = [max(r["summary"]["replica_shares"].values(), default=1.0) for r in rounds["raykv"]]
    answered = all(r["summary"]["ok"] for r in rounds["raykv"])
    if report.require("max_replica_share", answered, "raykv answered no request in a round"):
        report.ratio("max_replica_share", statistics.median(shares), shares)


def print_rounds(rounds: dict[str, list[dict]]) -> None:
    rows = []
    for name, per_round in rounds.items():
        for index, figures_of_round in enumerate(per_round):
            s = figures_of_round["summary"]
            rows.append([f"{name} r{index}", str(s["requests"]), str(s["errors"]),
                         f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}",
                         f"{s['cached_ratio']:.2f}", str(figures_of_round["evicted_pages"]),
                         " ".join(f"{v:.2f}" for v in s["replica_shares"].values())])
    common.print_tables([common.table(
        "the same trace per round, four contenders",
        ["contender", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "cached/prompt",
         "evicted pages", "replica shares"], rows)])


def plot(rounds: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, shares) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, per_round in rounds.items():
        ttft = sorted(t for r in per_round for t in r["ttft_ms"])
        cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
        last = list(per_round[-1]["summary"]["replica_shares"].values())
        shares.bar([f"{name}\n{i}" for i in range(len(last))], last)
    cdf.set_xscale("log")
    cdf.set_xlabel("time to first token (ms, log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT, every round's requests")
    cdf.legend()
    shares.axhline(1 / NUM_NODES, color="gray", linestyle="--", linewidth=1)
    shares.set_ylabel("share of requests (last round)")
    shares.set_title("requests per replica")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def notes(plan: Plan) -> list[str]:
    shape, num_requests = plan.shape, plan.shape.num_sessions * plan.shape.turns_per_session
    return [
        f"workload per round: {shape.num_sessions} sessions x {shape.turns_per_session} turns "
        f"= {num_requests} requests per contender ({num_requests * plan.num_rounds} in all), "
        f"{shape.num_tenants} tenants' system prompts of {shape.system_chars} characters "
        f"(byte tokens; Zipf {shape.zipf_s}), user turns of {shape.user_chars}, max_tokens "
        f"{shape.max_tokens}, streamed, {CONCURRENCY} client threads; a fresh set of "
        f"sessions every round; {MODEL}, {PAGE_TOKENS}-token pages, {NUM_NODES} nodes.",
        f"memory: raykv's tiers per node host {plan.host_bytes // MiB} MiB + disk "
        f"{plan.disk_bytes // MiB} MiB; each local replica's own cache holds the same "
        f"{plan.local_cache_bytes // MiB} MiB (all of it in process memory).",
        "*_vs_local_prefix: raykv against, per round, the stronger of local-pow2 and "
        "local-prefix (the lower TTFT p50 that round; see stronger_local per round), paired "
        "and the median taken. ttft_p50_vs_prefix_router: both on raykv's cache. TTFT is the "
        "HTTP client's, to the first streamed token; cached tokens are "
        "usage.prompt_tokens_details.cached_tokens summed (local hits counted the same way).",
    ]


def run(json_path: str | None, quick: bool, plot_path: str | None = None) -> dict:
    from rich.progress import Progress

    plan = plan_for(quick)
    traces = [round_trace(plan, i) for i in range(plan.num_rounds)]
    rounds: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    config = {"model": MODEL, "nodes": NUM_NODES, "concurrency": CONCURRENCY,
              "trace": dataclasses.asdict(plan.shape), "rounds": plan.num_rounds,
              "local_cache_bytes": plan.local_cache_bytes, "quick": quick}
    report = Report("serve", "ms", config, GOALS, notes(plan))

    def contender(name: str):
        def one_round(round_index: int) -> float:
            rounds[name].append(run_contender(name, plan, traces[round_index]))
            return rounds[name][-1]["summary"]["ttft_p50_ms"]
        return one_round

    with simulated_cluster(NUM_NODES), Progress() as progress:
        steps = common.Steps(progress, "serve", plan.num_rounds)
        order = interleave({name: contender(name) for name in CONTENDERS}, plan.num_rounds,
                           on_round=lambda i, names: steps(f"round {i}: {' '.join(names)}"))
    report["phase_s"] = steps.laps()
    print_rounds(rounds)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(rounds, plot_path)
    report["ttft_p50_ms_per_round"] = order
    report["per_round"] = {n: [{**r["summary"], "evicted_pages": r["evicted_pages"],
                                "cache": r["cache"]} for r in per_round]
                           for n, per_round in rounds.items()}
    report["stronger_local_per_round"] = [stronger_local(rounds, i)
                                          for i in range(plan.num_rounds)]
    report["ttft_ms"] = {n: [r["ttft_ms"] for r in per_round] for n, per_round in rounds.items()}
    fill_ratios(report, rounds)
    return report.finish(json_path)
