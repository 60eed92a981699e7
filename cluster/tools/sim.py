"""`raykv sim`: a block trace (Mooncake's format) through raykv's own policies, offline.

Only the eviction part exists so far (`--part eviction`); routing and scale come later.

    eviction   one global cache of C blocks, C in CAPACITIES_BLOCKS, per eviction policy that
               raykv ships (policies/eviction.py, through the same registry as the node
               store) and Belady's prefix-closed optimum (cluster/core/belady.py). Each
               request hits the longest prefix of its blocks that the cache holds
               (cluster/core/sim_cache.py: DirectoryIndex lookup, policy victims, puts).
               The hit ratio is hit tokens (whole 512-token blocks) over input tokens. Only
               a prompt's full blocks are cached (raykv keys full pages only), for every
               contender, Belady included.

Ratios (no rounds: the simulation is deterministic, so each is one exact figure):
    eviction_vs_belady_min   min over C >= 5k blocks of raykv's default policy / Belady
    eviction_vs_lru_min      min over every C of raykv's default policy / LRU
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cluster.core.belady import belady_hits
from cluster.core.config import CacheConfig
from cluster.core.keys import KeyChain
from cluster.core.sim_cache import GlobalCache
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import (
    BLOCK_TOKENS,
    BlockKeys,
    hit_tokens,
    read_trace,
    unlimited_hit_ratio,
)
from cluster.tools.bench.harness import Report
from policies.eviction import EVICTION_POLICIES, make_policy

PARTS = ("eviction",)
CAPACITIES_BLOCKS = (1000, 2000, 5000, 10000, 20000, 50000)
GOAL_MIN_CAPACITY_BLOCKS = 5000  # about one node's terabyte of DRAM for LLaMA3-70B
GOALS = {"eviction_vs_belady_min": {"min": 0.8}, "eviction_vs_lru_min": {"min": 1.0}}
MODEL = "small-llama"  # only names the key chain's root; eviction does not depend on it
Step = Callable[[str], None]


def default_policy() -> str:
    """raykv's default eviction policy (CacheConfig.eviction)."""
    return CacheConfig.model_fields["eviction"].default


def trace_chains(path: str, limit: int | None = None) -> tuple[list, list[list[bytes]]]:
    """The trace's requests and the page keys of each one's full blocks: raykv keys only
    full pages, so a prompt's partial last block is neither stored nor hit."""
    requests = read_trace(path, limit)
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


def plot_eviction(eviction: dict, png_path: str, title: str) -> None:
    """Hit ratio against capacity, one line per policy and the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    capacities = eviction["capacity_blocks"]
    for name, ratios in eviction["hit_ratio"].items():
        if name == "raykv":
            continue  # drawn under its policy's own name
        label = f"{name} (raykv default)" if name == default_policy() else name
        style = {"color": "black", "linestyle": "--"} if name == "belady" else {}
        axis.plot(capacities, [100 * r for r in ratios], marker="o", label=label, **style)
    axis.axhline(100 * eviction["unlimited_hit_ratio"], color="grey", linewidth=0.8,
                 linestyle=":", label="unlimited capacity")
    axis.set_xscale("log")
    axis.set_xlabel("capacity (512-token blocks)")
    axis.set_ylabel("hit ratio (% of input tokens)")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def run(trace_path: str, json_path: str | None = None, plot_path: str | None = None,
        parts: Sequence[str] = PARTS, limit: int | None = None) -> dict:
    """Simulate `parts` of the trace; the result as written to `json_path`."""
    from rich.progress import Progress

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; this version has {list(PARTS)}")
    started_s = time.perf_counter()
    requests, chains = trace_chains(trace_path, limit)
    input_tokens = sum(r.input_tokens for r in requests)
    names = ["belady", *EVICTION_POLICIES]
    with Progress(transient=True) as progress:
        task = progress.add_task("eviction", total=len(CAPACITIES_BLOCKS) * len(names))

        def step(what: str) -> None:
            progress.update(task, advance=1, description=f"eviction: {what}")

        hit_ratio = eviction_hit_ratios(chains, input_tokens, CAPACITIES_BLOCKS, step)
    eviction = {"capacity_blocks": list(CAPACITIES_BLOCKS), "hit_ratio": hit_ratio,
                "default_policy": default_policy(),
                "unlimited_hit_ratio": hit_tokens(unlimited_hits(chains)) / input_tokens,
                "unlimited_hit_ratio_all_blocks": unlimited_hit_ratio(requests)}
    report = Report("sim", "token hit ratio", _config(trace_path, requests, limit), GOALS,
                    _notes(len(requests), len(chains)))
    report["eviction"] = eviction
    for name, value in eviction_ratios(CAPACITIES_BLOCKS, hit_ratio).items():
        if report.require(name, value is not None, "no capacity to compare at"):
            report.ratio(name, value)
    report["wall_s"] = time.perf_counter() - started_s
    if plot_path:
        plot_eviction(eviction, plot_path, f"{len(requests)} requests of {Path(trace_path).name}")
    return report.finish(json_path)


def _config(trace_path: str, requests: list, limit: int | None) -> dict:
    return {"trace": trace_path, "num_requests": len(requests), "limit": limit,
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
