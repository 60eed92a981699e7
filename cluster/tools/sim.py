"""`raykv sim`: a block trace (Mooncake's format) through raykv's own policies, offline.

    eviction   one global cache of C blocks, C in CAPACITIES_BLOCKS, per eviction policy that
               raykv ships (policies/eviction.py, through the same registry as the node
               store) and Belady's prefix-closed optimum (cluster/core/belady.py). Each
               request hits the longest prefix of its blocks that the cache holds
               (cluster/core/sim_cache.py: DirectoryIndex lookup, policy victims, puts).
               The hit ratio is hit tokens (whole 512-token blocks) over input tokens. Only
               a prompt's full blocks are cached (raykv keys full pages only), for every
               contender, Belady included. Beside them, an oracle that is told which pages
               are dead (never used again) and evicts those first, LRU otherwise
               ("oracle_dead_first_lru"): what knowing the future reuse alone is worth.
    routing    16 nodes of the H100 profile: raykv's router and shared tiers against the
               baselines (cluster/tools/sim_parts.py, cluster/core/sim_routers.py), TTFT and
               hit ratio; and one global cache of the same total capacity
    scale      4 to 1024 nodes at a constant load per node: hit ratio, TTFT, cross-node
               bytes, directory operations per shard, shard imbalance, the simulator's speed
    fig10      Mooncake's Fig. 10 setting (10 nodes x 3M tokens of LLaMA3-70B in DRAM): local
               caches against raykv's global one, under LRU and raykv's default policy, beside
               the paper's figures (cluster/tools/sim_fig10.py); figures, and the goal
               sim_hit_vs_global_bound (raykv's global cache over the pooled one)

Ratios (no rounds: the simulation is deterministic, so each is one exact figure):
    eviction_vs_belady_min     min over C >= 5k blocks of raykv's default policy / Belady
    eviction_vs_lru_min        min over every C of raykv's default policy / LRU
    sim_ttft_p50_vs_best_peer  raykv's TTFT p50 / the least p50 of the baselines (N = 16)
    sim_ttft_p99_vs_best_peer  the same at p99
    sim_hit_vs_global_bound    raykv's hit ratio / one pooled cache's of the same capacity, in
                               the fig10 part's setting (10 nodes x 3M tokens: the capacity
                               forces eviction; at the routing part's 16 nodes nothing is
                               evicted, so there it is a figure, routing_hit_vs_global_bound)
    sim_nodes_max              the most nodes simulated
    sim_speed_vs_realtime      trace seconds per wall second at N = 16
    directory_shard_imbalance  the busiest shard's key operations / the mean (N = 1024)

Figures without a goal go under "figures" (fig10_local_hit_ratio, fig10_global_hit_ratio, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.core.belady import belady_hits
from cluster.core.config import CacheConfig
from cluster.core.keys import KeyChain
from cluster.core.sim_cache import GlobalCache, dead_first_lru_hits
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import (
    BLOCK_TOKENS,
    BlockKeys,
    TraceError,
    hit_tokens,
    read_trace,
    unlimited_hit_ratio,
)
from cluster.tools import sim_fig10, sim_parts, sim_plot
from cluster.tools.bench.harness import Report
from policies.eviction import EVICTION_POLICIES, make_policy

PARTS = ("eviction", "routing", "scale", "fig10")
CAPACITIES_BLOCKS = (1000, 2000, 5000, 10000, 20000, 50000)
GOAL_MIN_CAPACITY_BLOCKS = 5000  # about one node's terabyte of DRAM for LLaMA3-70B
EVICTION_GOALS = {"eviction_vs_belady_min": {"min": 0.8}, "eviction_vs_lru_min": {"min": 1.0}}
ROUTING_GOALS = {"sim_ttft_p50_vs_best_peer": {"max": 0.8},
                 "sim_ttft_p99_vs_best_peer": {"max": 0.7}}
FIG10_GOALS = {"sim_hit_vs_global_bound": {"min": 0.95}}
SCALE_GOALS = {"sim_nodes_max": {"min": 1024}, "sim_speed_vs_realtime": {"min": 100},
               "directory_shard_imbalance": {"max": 1.2}}
GOALS = {**EVICTION_GOALS, **ROUTING_GOALS, **SCALE_GOALS, **FIG10_GOALS}
PART_GOALS = {"eviction": EVICTION_GOALS, "routing": ROUTING_GOALS, "scale": SCALE_GOALS,
              "fig10": FIG10_GOALS}
MODEL = "small-llama"  # only names the key chain's root; eviction does not depend on it
Step = Callable[[str], None]


def default_policy() -> str:
    """raykv's default eviction policy (CacheConfig.eviction)."""
    return CacheConfig.model_fields["eviction"].default


def trace_chains(path: str, limit: int | None = None, start_s: float | None = None
                 ) -> tuple[list, list[list[bytes]]]:
    """The trace's requests and the page keys of each one's full blocks: raykv keys only
    full pages, so a prompt's partial last block is neither stored nor hit. With start_s,
    only the requests from start_s seconds on, their timestamps moved back by start_s (so
    the simulated cluster starts cold, at time 0); limit counts the requests kept.
    TraceError (naming the file) for a trace that cannot be read or leaves nothing to
    simulate."""
    requests = read_trace(path, None if start_s else limit)
    if start_s:
        start_ms = 1000.0 * start_s
        requests = [replace(r, timestamp_ms=r.timestamp_ms - start_ms) for r in requests
                    if r.timestamp_ms >= start_ms][:limit]
        if not requests:
            raise TraceError(f"{path}: no requests from {start_s:g} s on")
    if not any(r.input_tokens for r in requests):
        raise TraceError(f"{path}: no input tokens in the requests read")
    keys = BlockKeys(KeyChain.of(ModelSpec.preset(MODEL), "default", BLOCK_TOKENS))
    return requests, [keys.keys(r)[: r.input_tokens // BLOCK_TOKENS] for r in requests]


def unlimited_hits(chains: Sequence[Sequence[bytes]]) -> int:
    """Hit blocks of a cache that never evicts."""
    return sum(belady_hits(chains, len({key for chain in chains for key in chain})))


def policy_hits(name: str, chains: Sequence[Sequence[bytes]], capacity_blocks: int) -> int:
    """Hit blocks of the whole trace under one of raykv's policies (or "belady")."""
    if name == "belady":
        return sum(belady_hits(chains, capacity_blocks))
    cache = GlobalCache(make_policy(name, capacity_blocks), capacity_blocks)
    return sum(cache.serve(chain) for chain in chains)


def eviction_hit_ratios(chains: Sequence[Sequence[bytes]], input_tokens: int,
                        capacities_blocks: Sequence[int], step: Step | None = None
                        ) -> dict[str, list[float]]:
    """name -> token hit ratio per capacity: "belady", every shipped policy, and "raykv"
    (the default policy's figures under its own name as well)."""
    names = ["belady", *EVICTION_POLICIES]
    out: dict[str, list[float]] = {name: [] for name in names}
    for capacity_blocks in capacities_blocks:
        for name in names:
            if step:
                step(f"{name} at {capacity_blocks} blocks")
            hits = policy_hits(name, chains, capacity_blocks)
            out[name].append(hit_tokens(hits) / input_tokens)
    return {"raykv": list(out[default_policy()]), **out}


def eviction_ratios(capacities_blocks: Sequence[int], hit_ratio: dict[str, list[float]]
                    ) -> dict[str, float | None]:
    """The two eviction ratios; None where no capacity qualifies."""
    raykv, belady, lru = hit_ratio["raykv"], hit_ratio["belady"], hit_ratio["lru"]
    vs_belady = [r / b for c, r, b in zip(capacities_blocks, raykv, belady, strict=True)
                 if c >= GOAL_MIN_CAPACITY_BLOCKS and b > 0]
    vs_lru = [r / base for r, base in zip(raykv, lru, strict=True) if base > 0]
    return {"eviction_vs_belady_min": min(vs_belady) if vs_belady else None,
            "eviction_vs_lru_min": min(vs_lru) if vs_lru else None}


@dataclass(frozen=True, slots=True)
class Bounds:
    """How much of the trace to simulate: its first `limit` requests (all when None) from
    `start_s` seconds on (from the start when None; a held-out part of the trace, started
    cold), and in the scale part above 16 nodes its first `window_s` seconds (all when
    None)."""

    limit: int | None = None
    window_s: float | None = None
    start_s: float | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be at least 1 request, got {self.limit}")


def run(trace_path: str, json_path: str | None = None, plot_path: str | None = None,
        parts: Sequence[str] = PARTS, bounds: Bounds = Bounds()) -> dict:
    """Simulate `parts` of the trace; the result as written to `json_path`."""
    from rich.progress import Progress

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; this version has {list(PARTS)}")
    started_s = time.perf_counter()
    requests, chains = trace_chains(trace_path, bounds.limit, bounds.start_s)
    goals = {name: goal for part in parts for name, goal in PART_GOALS[part].items()}
    report = Report("sim", "token hit ratio; TTFT s", _config(trace_path, requests, bounds),
                    goals, _notes(len(requests), len(chains)))
    with Progress(transient=True) as progress:
        task = progress.add_task("sim", total=None)

        def step(what: str) -> None:
            progress.update(task, advance=1, description=what)

        if "eviction" in parts:
            _eviction(report, requests, chains, step)
        if "fig10" in parts:
            report["fig10"] = sim_fig10.fig10_part(requests, step)
            _add_figures(report, sim_fig10.fig10_figures(report["fig10"]))
            _set_ratios(report, sim_fig10.fig10_ratios(report["fig10"]))
        if "routing" in parts:
            report["routing"] = sim_parts.routing_part(requests, step)
            _set_ratios(report, sim_parts.routing_ratios(report["routing"]))
            _add_figures(report, sim_parts.routing_figures(report["routing"]))
        if "scale" in parts:
            report["scale"] = sim_parts.scale_part(requests, sim_parts.SCALE_NODES,
                                                   bounds.window_s,
                                                   step)
            _set_ratios(report, sim_parts.scale_ratios(report["scale"]))
    report["wall_s"] = time.perf_counter() - started_s
    report.note(sim_parts.NOTE)
    if plot_path:
        sim_plot.plot(report.result, plot_path,
                      f"{len(requests)} requests of {Path(trace_path).name}")
    return report.finish(json_path)


def _eviction(report: Report, requests: list, chains: list, step: Step) -> None:
    input_tokens = sum(r.input_tokens for r in requests)
    hit_ratio = eviction_hit_ratios(chains, input_tokens, CAPACITIES_BLOCKS,
                                    lambda what: step(f"eviction: {what}"))
    oracle = []
    for capacity_blocks in CAPACITIES_BLOCKS:
        step(f"eviction: dead-first LRU oracle at {capacity_blocks} blocks")
        hits = sum(dead_first_lru_hits(chains, capacity_blocks))
        oracle.append(hit_tokens(hits) / input_tokens)
    report["eviction"] = {"capacity_blocks": list(CAPACITIES_BLOCKS), "hit_ratio": hit_ratio,
                          "oracle_dead_first_lru": oracle,
                          "default_policy": default_policy(),
                          "unlimited_hit_ratio": hit_tokens(unlimited_hits(chains))
                          / input_tokens,
                          "unlimited_hit_ratio_all_blocks": unlimited_hit_ratio(requests)}
    _set_ratios(report, eviction_ratios(CAPACITIES_BLOCKS, hit_ratio))


def _set_ratios(report: Report, ratios: dict[str, float | None]) -> None:
    for name, value in ratios.items():
        if report.require(name, value is not None, "nothing to compare at"):
            report.ratio(name, value)


def _add_figures(report: Report, figures: dict[str, float]) -> None:
    report["figures"] = {**report.result.get("figures", {}), **figures}


def _config(trace_path: str, requests: list, bounds: Bounds) -> dict:
    return {"trace": trace_path, "num_requests": len(requests), "limit": bounds.limit,
            "window_s": bounds.window_s, "start_s": bounds.start_s,
            "block_tokens": BLOCK_TOKENS, "capacities_blocks": list(CAPACITIES_BLOCKS),
            "policies": list(EVICTION_POLICIES), "default_policy": default_policy(),
            "goal_min_capacity_blocks": GOAL_MIN_CAPACITY_BLOCKS}


def _notes(num_requests: int, num_chains: int) -> list[str]:
    return [f"eviction: {num_requests} requests, one global cache per capacity and policy; "
            "a request hits the longest prefix of its full 512-token blocks that the cache "
            "holds (hit ratio = 512 x hit blocks / input tokens; a partial last block is "
            "never cached, as raykv keys full pages only)",
            "belady: the offline optimum closed under prefixes, with bypass (an upper bound "
            "for any policy); raykv: the default policy (CacheConfig.eviction)",
            "pages whose ancestor was evicted stay stored but unreachable (no cascade), as in "
            "the node store"]
