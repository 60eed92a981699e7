"""`raykv bench trace`'s simulated side: the live configuration as `raykv sim` runs it.

For each live contender, the same simulator as `raykv sim` (cluster/core/sim_cluster.py with
the routers of sim_routers.py and raykv's eviction policies and control loop), set up as the
live run was:

    nodes       3, each one engine (the live app runs one replica per simulated node)
    capacities  in pages, what the live tiers hold: raykv's host tier per node (no device or
                disk tier, live or simulated), or each local replica's own cache
    eviction    raykv: CacheConfig's default policy, as the live pool runs; local: LRU
    router      raykv -> "raykv" (shared tiers, the directory's answer), local-pow2 -> "pow2",
                local-prefix -> "prefix_affinity" (Ray Serve LLM's router, re-created)
    control     raykv's control loop every rebalance_period_s, when the service runs it
    requests    the same scaled requests, at the compressed times the live replay sent them;
                page keys are raykv's chained keys of the very tokens the service receives
    time        an engine's prefill is fitted to the live run it is compared with: each
                answered request's service time is read off its replica's departures
                (service_times: answer time - max(send time, the replica's previous answer),
                the queue left out), and seconds = overhead + per token x uncached tokens is
                the line through the median service time of five groups of request sizes
                (fit_engine); the prefix's fetch is in the fit, its own cost zero

The simulated hit ratio is its cached tokens over prompt tokens (the sim's tally: 512 per hit
page over input tokens, with each live token standing for 512 / page_tokens trace tokens, so
the ratio is the live one's measure exactly).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from actors.handles import merge_shard_prefixes, split_by_shard
from cluster.core.config import CacheConfig
from cluster.core.keys import KeyChain
from cluster.core.sim_cluster import SimCluster, SimDirectory, SimRequest
from cluster.core.sim_control import SimControlLoop
from cluster.core.sim_profiles import DEFAULT_PROFILE, PROFILES, HardwareProfile, ModelCost
from cluster.core.sim_routers import make_router
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import BLOCK_TOKENS
from cluster.core.trace_scale import Scale, ScaledRequest
from cluster.serving import tokenizer
from cluster.tools.sim_parts import figures

NUM_NODES = 3
# live contender -> (simulated router, whether it has raykv's shared tiers)
SIM_ROUTERS = {"raykv": ("raykv", True), "local-pow2": ("pow2", False),
               "local-prefix": ("prefix_affinity", False)}
LOCAL_EVICTION = "lru"  # the live local cache (cluster/core/prefix_lru.py) is an LRU
FREE = 1e18  # bytes/s of a path whose cost is inside the fitted prefill
MIN_TOKEN_S = 1e-9  # a fit with no measurable cost per token (see FittedProfile)
FIT_BINS = 5
FIT_QUANTILE = 0.5


@dataclass(frozen=True, slots=True)
class SimSetup:
    """One live contender's configuration, as the simulator takes it."""

    router: str
    shared: bool
    eviction: str
    capacities_pages: tuple[int, int, int]  # device, host, disk per node
    control_period_s: float | None  # raykv's control loop, or None


def sim_setup(contender: str, host_pages: int, local_pages: int,
              config: CacheConfig | None = None) -> SimSetup:
    """The simulator's set-up for a live contender with these capacities per node."""
    config = config or CacheConfig()
    router, shared = SIM_ROUTERS[contender]
    if shared:
        period_s = config.rebalance_period_s if config.rebalance else None
        return SimSetup(router, True, config.eviction, (0, host_pages, 0), period_s)
    return SimSetup(router, False, LOCAL_EVICTION, (0, local_pages, 0), None)


@dataclass(frozen=True, slots=True)
class EngineFit:
    """A live engine's time per request: overhead_s + per_token_s x uncached live tokens."""

    overhead_s: float
    per_token_s: float


def service_times(sent_at_s: Sequence[float], ttft_s: Sequence[float],
                  replicas: Sequence[str]) -> list[float]:
    """Each request's time on its replica, queueing left out: its answer time less the later
    of its send and the previous answer of the same replica (a replica's requests in answer
    order). For one server in first-come order this is exactly the service time; for a
    replica that interleaves two requests it splits their shared busy time between them, so
    a replica's service times still sum to its busy time."""
    out = [0.0] * len(ttft_s)
    previous: dict[str, float] = {}
    done_s = [sent + ttft for sent, ttft in zip(sent_at_s, ttft_s, strict=True)]
    for index in sorted(range(len(done_s)), key=done_s.__getitem__):
        started_s = max(sent_at_s[index], previous.get(replicas[index], -math.inf))
        out[index] = done_s[index] - started_s
        previous[replicas[index]] = done_s[index]
    return out


def fit_engine(uncached_tokens: Sequence[int], times_s: Sequence[float],
               num_bins: int = FIT_BINS, quantile: float = FIT_QUANTILE) -> EngineFit:
    """The engine's time per request (`times_s`: service_times): the requests cut into
    `num_bins` equal groups by uncached tokens, each group's `quantile` of time against its
    median size, and the least-squares line through those points, clamped non-negative."""
    import numpy as np

    if not len(times_s):
        return EngineFit(0.0, 0.0)
    order = np.argsort(np.asarray(uncached_tokens, float), kind="stable")
    sizes = np.asarray(uncached_tokens, float)[order]
    times = np.asarray(times_s, float)[order]
    groups = [g for g in zip(np.array_split(sizes, num_bins), np.array_split(times, num_bins),
                             strict=True) if len(g[0])]
    x = np.array([np.median(size) for size, _ in groups])
    y = np.array([np.quantile(time_s, quantile) for _, time_s in groups])
    if len(set(x.tolist())) < 2:
        return EngineFit(float(np.mean(y)), 0.0)
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:  # no measurable cost per token: the level is the overhead
        return EngineFit(float(np.mean(y)), 0.0)
    return EngineFit(max(0.0, float(intercept)), float(slope))


@dataclass(frozen=True, slots=True)
class FittedProfile(HardwareProfile):
    """A node whose prefill takes overhead_s + per_trace_token_s x uncached trace tokens."""

    overhead_s: float = 0.0
    per_trace_token_s: float = 0.0

    def prefill_s(self, model: ModelCost, cached_tokens: int, total_tokens: int) -> float:
        return self.overhead_s + self.per_trace_token_s * max(0, total_tokens - cached_tokens)

    def prefill_tokens_per_s(self, model: ModelCost) -> float:
        """The fitted rate, what raykv's cost router weighs a fetch against. A fit that found
        no cost per token still charges MIN_TOKEN_S a token: recomputing is never free, and
        every path here is FREE, so fetching stays the cheaper, as the live engine does."""
        return 1.0 / max(self.per_trace_token_s, MIN_TOKEN_S)


def scaled_model(page_bytes: int) -> ModelCost:
    """The live model as the simulator sees it: only its page bytes matter (per 512 tokens)."""
    if page_bytes % BLOCK_TOKENS:
        raise ValueError(f"a page of {page_bytes} bytes is not a whole number of bytes per "
                         f"trace token")
    return ModelCost("live-scaled", 0.0, 0, 0, 0, page_bytes // BLOCK_TOKENS)


def fitted_profile(setup: SimSetup, fit: EngineFit, scale: Scale,
                   page_bytes: int) -> FittedProfile:
    device, host, disk = setup.capacities_pages
    base = PROFILES[DEFAULT_PROFILE]
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(HardwareProfile)}
    fields.update(name="live-fitted", num_gpus=1, device_kv_bytes=device * page_bytes,
                  host_kv_bytes=host * page_bytes, disk_kv_bytes=disk * page_bytes,
                  hbm_bytes_per_s=FREE, host_to_device_bytes_per_s=FREE,
                  disk_bytes_per_s=FREE, nic_bytes_per_s=FREE, host_latency_s=0.0,
                  disk_latency_s=0.0, nic_latency_s=0.0)
    return FittedProfile(**fields, overhead_s=fit.overhead_s,
                         per_trace_token_s=fit.per_token_s / scale.tokens_per_live_token)


def sim_requests(requests: Sequence[ScaledRequest], scale: Scale, model: str,
                 send_at_s: Sequence[float] | None = None) -> list[SimRequest]:
    """The scaled requests with raykv's page keys of the tokens the service receives, at
    `send_at_s` (when the replay sent them; the schedule when None), in trace units."""
    chain = KeyChain.of(ModelSpec.preset(model), "default", scale.page_tokens)
    times = send_at_s if send_at_s is not None else [r.send_at_s for r in requests]
    out = []
    for request, at_s in zip(requests, times, strict=True):
        keys = chain.keys(tokenizer.encode(request.text))
        if len(keys) != request.num_full_blocks:
            raise ValueError(f"request {request.index}: {len(keys)} pages for "
                             f"{request.num_full_blocks} full blocks")
        out.append(SimRequest(at_s, keys, request.prompt_tokens * scale.tokens_per_live_token,
                              len(request.block_ids)))
    return out


def make_cluster(setup: SimSetup, profile: FittedProfile, page_bytes: int,
                 config: CacheConfig | None = None) -> SimCluster:
    config = config or CacheConfig()
    directory = None
    if setup.shared:
        directory = SimDirectory(config.num_directory_shards, split_by_shard,
                                 merge_shard_prefixes)
    cluster = SimCluster(profile, scaled_model(page_bytes), NUM_NODES, setup.eviction, directory)
    if tuple(cluster.capacities) != setup.capacities_pages:
        raise AssertionError(f"simulated capacities {cluster.capacities} are not the live "
                             f"{setup.capacities_pages}")
    if setup.control_period_s is not None:
        cluster.control = SimControlLoop(setup.control_period_s)
    return cluster


def simulate(setup: SimSetup, fit: EngineFit, scale: Scale, page_bytes: int,
             requests: Sequence[SimRequest]) -> dict:
    """The contender's simulated cluster through the requests: sim_parts.figures, with
    "hit_ratio" cached over prompt tokens and the pages each node evicted."""
    cluster = make_cluster(setup, fitted_profile(setup, fit, scale, page_bytes), page_bytes)
    choose = make_router(setup.router)
    for request in requests:
        cluster.serve(request, choose)
    cluster.finish()
    out = figures(cluster, requests, 0.0)
    out["evicted_pages"] = sum(sum(node.evictions) for node in cluster.nodes)
    out["fit"] = dataclasses.asdict(fit)
    return out
