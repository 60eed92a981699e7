"""`raykv sim`'s routing and scale parts: the trace on a simulated cluster (cluster/core/
sim_cluster.py), raykv's router and shared tiers against the baselines (sim_routers.py).

    routing   N = 16 nodes of the H100 profile (400 GbE), the trace replicated so that each
              node carries the load of a quarter of it (see scale); every router of
              sim_routers.ROUTERS on its own fresh cluster; plus one global cache of the
              cluster's total capacity under raykv's default policy (the hit bound)
    scale     N in SCALE_NODES, raykv only, the trace replicated N / NODES_PER_COPY times
              (fresh block ids per copy, a seeded clock offset below a minute), so the load
              per node stays constant; `window_s` keeps only the first seconds of it for
              N > WINDOW_ABOVE_NODES (N = 4 and 16 always run the whole trace: the speed
              goal is the hour at N = 16), and each windowed N reports the wall time the
              whole trace would take at the speed it measured

The directory has min(64, max(1, N / 16)) shards (CacheConfig caps it at 64); its lookups use
the client's own split_by_shard and merge_shard_prefixes (actors/handles.py).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

from actors.handles import merge_shard_prefixes, split_by_shard
from cluster.core.config import CacheConfig
from cluster.core.keys import KeyChain
from cluster.core.sim_cache import GlobalCache
from cluster.core.sim_cluster import SOURCE_NAMES, SimCluster, SimDirectory, SimRequest
from cluster.core.sim_control import SimControlLoop
from cluster.core.sim_events import num_copies, scale_trace
from cluster.core.sim_profiles import DEFAULT_PROFILE, PROFILES, llama3_70b
from cluster.core.sim_routers import ROUTERS, SHARED, make_router
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import BLOCK_TOKENS, BlockKeys, BlockRequest
from policies.eviction import make_policy

ROUTING_NODES = 16
SCALE_NODES = (4, 16, 64, 256, 1024)
WINDOW_ABOVE_NODES = 16
NODES_PER_COPY = 4  # the trace as it is loads 4 nodes (~30 % busy on the H100 profile)
BASELINE_EVICTION = "lru"  # vLLM's and Mooncake's caches evict LRU
MODEL = "small-llama"  # names the key chain's root only (as the eviction part)
Step = Callable[[str], None]


def default_policy() -> str:
    return CacheConfig.model_fields["eviction"].default


def num_shards(num_nodes: int) -> int:
    return min(64, max(1, num_nodes // 16))


def sim_requests(requests: Sequence[BlockRequest], copies: int,
                 window_s: float | None = None) -> list[SimRequest]:
    """The trace replicated `copies` times, its first `window_s` seconds, as SimRequests
    keyed with raykv's keys of their full blocks."""
    scaled = scale_trace(requests, copies,
                         until_ms=None if window_s is None else window_s * 1000)
    keys = BlockKeys(KeyChain.of(ModelSpec.preset(MODEL), "default", BLOCK_TOKENS))
    return [SimRequest(r.timestamp_ms / 1000, keys.keys(r)[: r.input_tokens // BLOCK_TOKENS],
                       r.input_tokens, len(r.block_ids)) for r in scaled]


def make_cluster(router: str, num_nodes: int, profile: str = DEFAULT_PROFILE) -> SimCluster:
    directory = None
    if router in SHARED:
        directory = SimDirectory(num_shards(num_nodes), split_by_shard, merge_shard_prefixes)
    eviction = default_policy() if router == "raykv" else BASELINE_EVICTION
    cluster = SimCluster(PROFILES[profile], llama3_70b(), num_nodes, eviction, directory)
    config = CacheConfig()
    if router == "raykv" and config.rebalance:  # the service runs its control loop
        cluster.control = SimControlLoop(config.rebalance_period_s)
    return cluster


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def simulate(router: str, num_nodes: int, requests: Sequence[SimRequest]) -> dict:
    """One router's cluster through the requests; its figures."""
    return run_cluster(make_cluster(router, num_nodes), router, requests)


def run_cluster(cluster: SimCluster, router: str, requests: Sequence[SimRequest]) -> dict:
    """`cluster` through the requests, `router` choosing each one's node; its figures."""
    choose = make_router(router)
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    with paused_gc():
        for request in requests:
            cluster.serve(request, choose)
        cluster.finish()
    wall_s = time.perf_counter() - started_s
    out = figures(cluster, requests, wall_s)
    # On a shared machine the wall time counts other processes' turns; the CPU time is what
    # the simulation itself took (one thread).
    out["cpu_s"] = time.process_time() - started_cpu_s
    out["speed_vs_realtime_cpu"] = out["trace_span_s"] / out["cpu_s"] if out["cpu_s"] else 0.0
    if hasattr(choose, "recomputed"):  # raykv's: requests whose cut left cached pages unread
        out["recomputed_requests"] = choose.recomputed
    if hasattr(choose, "fallbacks"):  # raykv's: requests routed by power of two (no hit)
        out["fallback_requests"] = choose.fallbacks
    return out


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector off for a simulation. The simulation makes no reference
    cycles (none were found after a run with it off), but it keeps millions of live objects
    (policies' heaps, the directory's places), which every full collection walks: 20 % of
    a run's time at 16 nodes. Reference counting still frees everything else at once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            # Enabled as it is, the next allocation would collect the youngest generation:
            # every object the run made and still holds, walked for nothing (4 % of the
            # 16-node hour). Frozen and unfrozen, they join the oldest generation unwalked.
            gc.freeze()
            gc.enable()
            gc.unfreeze()


def figures(cluster: SimCluster, requests: Sequence[SimRequest], wall_s: float) -> dict:
    tally = cluster.tally
    control_bytes = cluster.control.counters["bytes"] if cluster.control else 0
    span_s = (requests[-1].arrival_s - requests[0].arrival_s) if requests else 0.0
    out = {"num_nodes": len(cluster.nodes), "num_requests": len(requests),
           "hit_ratio": tally.hit_tokens / tally.input_tokens if tally.input_tokens else 0.0,
           # the mean over requests of each one's hit tokens / input tokens
           "request_hit_ratio_mean": tally.request_hit_sum / len(tally.ttft_s)
           if tally.ttft_s else 0.0,
           "ttft_p50_s": percentile(tally.ttft_s, 0.5),
           "ttft_p99_s": percentile(tally.ttft_s, 0.99),
           "ttft_mean_s": statistics.fmean(tally.ttft_s) if tally.ttft_s else 0.0,
           "hits_by_source": dict(zip(SOURCE_NAMES, tally.hits_by_source, strict=True)),
           "cross_node_bytes": tally.remote_bytes + control_bytes,
           "cross_node_fetch_bytes": tally.remote_bytes,
           "engine_busy_fraction": (sum(q.busy_s for q in cluster.queues)
                                    / (len(cluster.queues) * span_s) if span_s else 0.0),
           "trace_span_s": span_s, "wall_s": wall_s,
           "speed_vs_realtime": span_s / wall_s if wall_s else 0.0}
    if cluster.control is not None:
        out["control_loop"] = dict(cluster.control.counters)
    if cluster.directory is not None:
        out["directory"] = directory_figures(cluster.directory, span_s)
    return out


def directory_figures(directory: SimDirectory, span_s: float) -> dict:
    ops = directory.key_ops
    mean = statistics.fmean(ops)
    return {"num_shards": len(ops),
            "key_ops_per_shard_per_s": mean / span_s if span_s else 0.0,
            "key_ops_per_shard_per_s_max": max(ops) / span_s if span_s else 0.0,
            "calls_per_shard_per_s": statistics.fmean(directory.calls) / span_s
            if span_s else 0.0,
            "shard_imbalance": max(ops) / mean if mean else 1.0}


def global_bound(cluster: SimCluster, requests: Sequence[SimRequest]) -> dict:
    """One global cache of the cluster's whole capacity under raykv's default policy: its
    hit ratio, and the TTFT floor it gives (its hits, no queue, a free fetch: prefill of the
    rest only), which no router on this cluster can beat."""
    capacity_blocks = len(cluster.nodes) * sum(cluster.capacities)
    cache = GlobalCache(make_policy(default_policy(), capacity_blocks), capacity_blocks)
    hits = 0
    floor_s = []
    for request in requests:
        num_hit = cache.serve(request.keys)
        hits += num_hit
        cached = min(num_hit * BLOCK_TOKENS, max(0, request.input_tokens - 1))
        floor_s.append(cluster.profile.prefill_s(cluster.model, cached, request.input_tokens))
    total = sum(r.input_tokens for r in requests)
    return {"hit_ratio": hits * BLOCK_TOKENS / total if total else 0.0,
            "capacity_blocks": capacity_blocks,
            "ttft_floor_p50_s": percentile(floor_s, 0.5),
            "ttft_floor_p99_s": percentile(floor_s, 0.99)}


def routing_part(requests: Sequence[BlockRequest], step: Step | None = None) -> dict:
    copies = num_copies(ROUTING_NODES, NODES_PER_COPY)
    sim = sim_requests(requests, copies)
    out: dict = {"num_nodes": ROUTING_NODES, "profile": DEFAULT_PROFILE, "copies": copies,
                 "routers": {}}
    for router in ROUTERS:
        if step:
            step(f"routing: {router}")
        out["routers"][router] = simulate(router, ROUTING_NODES, sim)
    if step:
        step("routing: global bound")
    out["global_bound"] = global_bound(make_cluster("pow2", ROUTING_NODES), sim)
    out["global_bound_hit_ratio"] = out["global_bound"]["hit_ratio"]
    return out


def routing_ratios(routing: dict) -> dict[str, float | None]:
    """The TTFT goals. raykv's hit ratio over the global bound's is a figure here
    (`routing_hit_vs_global_bound`, no goal): 16 nodes' tiers hold every block of the
    replicated trace, so the bound evicts nothing and the ratio cannot fall short; the goal
    `sim_hit_vs_global_bound` is measured where capacity forces eviction (the fig10 part)."""
    routers = routing["routers"]
    raykv = routers["raykv"]
    peers = [f for name, f in routers.items() if name != "raykv"]
    best_p50 = min(f["ttft_p50_s"] for f in peers)
    best_p99 = min(f["ttft_p99_s"] for f in peers)
    return {"sim_ttft_p50_vs_best_peer": raykv["ttft_p50_s"] / best_p50 if best_p50 else None,
            "sim_ttft_p99_vs_best_peer": raykv["ttft_p99_s"] / best_p99 if best_p99 else None}


def routing_figures(routing: dict) -> dict[str, float]:
    bound = routing["global_bound_hit_ratio"]
    raykv = routing["routers"]["raykv"]
    return {"routing_hit_vs_global_bound": raykv["hit_ratio"] / bound} if bound else {}


def scale_part(requests: Sequence[BlockRequest], nodes: Sequence[int] = SCALE_NODES,
               window_s: float | None = None, step: Step | None = None) -> dict:
    out: dict = {"nodes": list(nodes), "window_s": window_s, "per_nodes": {}}
    for num_nodes in nodes:
        if step:
            step(f"scale: {num_nodes} nodes")
        started_s = time.perf_counter()
        window = window_s if num_nodes > WINDOW_ABOVE_NODES else None
        copies = num_copies(num_nodes, NODES_PER_COPY)
        sim = sim_requests(requests, copies, window)
        keys_s = time.perf_counter() - started_s
        result = simulate("raykv", num_nodes, sim)
        result["keying_wall_s"] = keys_s
        result["window_s"] = window
        if window is not None and sim:
            whole_s = (max(r.timestamp_ms for r in requests) / 1000 if requests else 0.0)
            result["whole_trace_wall_s_estimate"] = (
                result["wall_s"] * (whole_s + 60.0) / max(result["trace_span_s"], 1e-9))
        out["per_nodes"][str(num_nodes)] = result
    return out


def scale_ratios(scale: dict) -> dict[str, float | None]:
    per = scale["per_nodes"]
    done = [int(n) for n, f in per.items() if f["num_requests"]]
    return {"sim_nodes_max": float(max(done)) if done else None,
            "sim_speed_vs_realtime": per["16"]["speed_vs_realtime"] if "16" in per else None,
            "directory_shard_imbalance": per["1024"]["directory"]["shard_imbalance"]
            if "1024" in per else None}


NOTE = ("routing/scale: each node is one 8-GPU LLaMA3-70B prefill engine, FIFO, one request "
        "at a time (decode not modelled); TTFT = queue wait + fetch of the cached prefix "
        "(per source: latency + bytes / bandwidth) + prefill (2N FLOPs a token plus the "
        "attention term, at 40 % MFU); the trace replicated N/4 times with fresh block ids; "
        "baselines' local caches evict LRU; raykv's tiers its default policy, and its control "
        "loop (policies/rebalance.py: replication, migration) runs every "
        "rebalance_period_s on snapshots of the simulated cluster, its copies landing at "
        "once; admission is not driven (no tenant limits in the trace); raykv's router "
        "estimates queue waits as the live one does (policies/queue_wait.py: a virtual "
        "queue of the predicted fetch and prefill seconds it sent each node, drained as "
        "requests end; power of two without a hit), Mooncake's sums the queued "
        "requests' predicted times; a page on another node's disk costs that disk's read "
        "and the NIC's")
