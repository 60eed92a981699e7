"""Who picks the node: raykv's router (policies/routing.py, as cluster/serving/router.py calls
it) and the baselines, re-created from their public descriptions.

Each router is `choose(cluster, request, located) -> node index`; `located` is the
directory's answer (None for the local-cache baselines, which see their own node's cache).

    raykv           policies/cost_routing.decide, fed as RaykvRouter feeds it: per node,
                    queue wait (the predicted seconds of the work it routed there still
                    ahead: policies/queue_wait.py's VirtualQueue, the live router's code,
                    fed by its routing and by each request's end) + the cheapest cut of
                    fetching the cached prefix (from its own tiers or another node's) and
                    recomputing the rest + prefill; the least. No page held
                    anywhere: power of two, as the live router falls back. Rates from the
                    profile (the simulator is their oracle; the service measures them).
                    Shared tiers.
    round_robin     node i mod N. Local caches.
    pow2            two nodes at random, the shorter queue: Ray Serve's default router,
                    https://docs.ray.io/en/latest/serve/advanced-guides/custom-request-router.html
                    Local caches.
    prefix_affinity Ray Serve LLM's PrefixCacheAffinityRouter,
                    https://docs.ray.io/en/latest/serve/llm/prefix-aware-request-router.html :
                    queue lengths within `imbalanced_threshold` -> the prefix tree of what was
                    routed where (never told of evictions); a match rate >= 0.1 -> the
                    replicas of the best match, else those with the smallest tree; then power
                    of two among them. Imbalanced -> power of two. Local caches.
    dynamo          NVIDIA Dynamo's KV router,
                    https://docs.nvidia.com/dynamo/design-docs/router-design :
                    cost = overlap_score_weight (1.0) x blocks to prefill on the worker (its
                    overlap from KV events, so exact) + its active blocks; the least cost.
                    Local caches.
    llmd            llm-d's precise prefix-cache scorer profile,
                    https://github.com/llm-d/llm-d-inference-scheduler (docs/architecture.md):
                    3 x prefix match (fraction of blocks, from KV events) + 2 x (1 - KV cache
                    utilisation) + 2 x queue score ((max - q) / (max - min)); the highest.
                    Local caches.
    prefix_match    the local-cache setup of Mooncake's Fig. 10 (Qin et al., FAST'25, 5.3.2,
                    https://www.usenix.org/conference/fast25/presentation/qin): "the global
                    scheduler is programmed to direct requests to nodes with higher prefix
                    match ratios": the node whose own cache holds the longest prefix; ties
                    (no match anywhere among them) to the shorter queue, then the lower
                    index. Local caches. Used by `raykv sim --part fig10` only.
    mooncake        Mooncake's Conductor (Qin et al., FAST'25, section 5 and Algorithm 1,
                    https://arxiv.org/abs/2407.00079): with the global KVCache pool's prefix
                    locations, the instance whose estimated TTFT (queue + transfer of the
                    prefix it lacks + prefill of the rest) is the least; the queue estimated
                    as the predicted times of the requests queued there, summed (each counted
                    whole), not the exact seconds left. Shared tiers, as raykv's: the same
                    directory and the same cross-node fetch.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from cluster.core.routed_prefixes import RoutedPrefixes
from cluster.core.sim_cluster import Route, SimCluster, SimRequest
from cluster.core.trace_format import BLOCK_TOKENS
from policies.cost_routing import DEVICE as DEVICE_PATH
from policies.cost_routing import DISK as DISK_PATH
from policies.cost_routing import HOST as HOST_PATH
from policies.cost_routing import REMOTE as REMOTE_PATH
from policies.cost_routing import (
    Candidate,
    Prompt,
    RateEstimates,
    best_sources,
    decide,
    prior_rates,
)
from policies.queue_wait import VirtualQueue, own_or_mean, queue_waits

Choose = Callable[[SimCluster, SimRequest, list | None], int | Route]
RAY_IMBALANCED_THRESHOLD = 10  # PrefixCacheAffinityRouter's default
RAY_MATCH_RATE_THRESHOLD = 0.1
DYNAMO_OVERLAP_WEIGHT = 1.0
LLMD_WEIGHTS = {"prefix": 3.0, "kv_utilisation": 2.0, "queue": 2.0}
SHARED = ("raykv", "mooncake")  # the contenders with raykv's directory and shared tiers


def _queues(cluster: SimCluster, now_s: float) -> list[int]:
    return cluster.queue_lengths(now_s)


def _pow2(rng: random.Random, candidates: list[int], queues: list[int]) -> int:
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(candidates, 2)
    return first if queues[first] <= queues[second] else second


class Pow2:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        return _pow2(self.rng, list(range(len(cluster.nodes))),
                     _queues(cluster, request.arrival_s))


class RoundRobin:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        node = self.next % len(cluster.nodes)
        self.next += 1
        return node


def oracle_rates(cluster: SimCluster) -> RateEstimates:
    """The rates the service measures online, read off the simulator's profile instead: each
    path's bandwidth and latency as `SimCluster.fetch_s` charges them, and the profile's
    prefill as the engines fit it (cluster/serving/prefill_fit.py): its tokens/s (the linear
    term) and its attention seconds per token pair."""
    p = cluster.profile
    return prior_rates({DEVICE_PATH: (p.hbm_bytes_per_s, 0.0),
                        HOST_PATH: (p.host_to_device_bytes_per_s, p.host_latency_s),
                        DISK_PATH: (p.disk_bytes_per_s, p.disk_latency_s),
                        REMOTE_PATH: (p.nic_bytes_per_s, p.nic_latency_s)},
                       p.prefill_tokens_per_s(cluster.model),
                       p.attention_s_per_pair(cluster.model))


class Raykv:
    """raykv's router, fed what RaykvRouter (cluster/serving/router.py) feeds
    policies/cost_routing.decide:
    - the directory's answer, lengthened by the pages it routed in the last `routed_ttl_s`
      (RoutedPrefixes, the live router's own);
    - no page held anywhere: power of two choices on the requests in flight (the live
      router's fallback: `has_hits(prefix_scores(...))` is false exactly when no page is
      located);
    - else each node's queue wait as the live router estimates it (policies/queue_wait.py):
      its virtual queue, the seconds `decide` priced each request it sent there at (fetch of
      its cut + prefill of the rest at the node's rate and attention term), worked off with
      the clock and drained when it hears (at the request's end, SimCluster.on_finished, as
      Serve's on_request_completed) that none of its requests is left there; plus requests it
      did not route (none here: it routes them all) at the node's measured compute seconds
      per request. Not the queue's exact remaining seconds;
    - the rates: the profile's (oracle_rates), where the live router pools what its engines
      measure online: their prefill's two terms are the profile's exactly here.
    The node of the least estimated TTFT, reading only the pages that are faster to fetch
    than to recompute. Candidates come in a seeded random order, so ties spread. What the
    sim leaves out: the routing stats' polling delay (a replica's figure reaches routers at
    once here), the ranking by weighted prefix before any replica has published, and the
    in-flight floor of a queue wait (one engine step: its simulated engines have no fixed
    cost per step)."""

    def __init__(self, seed: int = 0, routed_ttl_s: float = 3.0) -> None:
        self.rng = random.Random(seed)
        self.rates: RateEstimates | None = None
        self.routed = RoutedPrefixes(routed_ttl_s)
        self.queue = VirtualQueue()  # the live router's (RaykvRouter.virtual_queue)
        self._cluster: SimCluster | None = None  # the cluster whose completions it hears
        self.recomputed = 0  # requests cut short of their cached prefix
        self.fallbacks = 0  # requests routed by power of two (no page held anywhere)

    def _finished(self, request_id: int, node: int, finish_s: float) -> None:
        """A request ended (SimCluster.on_finished): Serve's on_request_completed."""
        self.queue.completed(request_id, finish_s)

    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> Route:
        if self._cluster is not cluster:
            self.rates = oracle_rates(cluster)
            self.queue = VirtualQueue()
            cluster.on_finished.append(self._finished)
            self._cluster = cluster
        now_s = request.arrival_s
        queued = cluster.queue_lengths(now_s)  # the live router's in-flight counts
        self.queue.withdraw(cluster.num_served, now_s)  # asked again for one request
        located = self.routed.extend(located or [], request.keys, now_s)
        node_ids = cluster.node_ids
        prompt = Prompt(request.input_tokens, BLOCK_TOKENS, cluster.page_bytes)
        if not located:
            self.fallbacks += 1
            node = _pow2(self.rng, list(range(len(node_ids))), queued)
            self.routed.record(request.keys, node_ids[node], now_s)
            self.queue.routed(node_ids[node], cluster.num_served,
                              self.rates.prefill_s(prompt, 0, node_ids[node]), now_s)
            return Route(node, 0)
        order = list(range(len(node_ids)))
        self.rng.shuffle(order)
        sources = best_sources(located, node_ids)
        busy = own_or_mean(dict(zip(node_ids, cluster.busy_s_per_request(), strict=True)))
        # One router here: every request in flight is its own, so `others` count none.
        waits = queue_waits(prompt, self.queue, {node_ids[i]: queued[i] for i in order},
                            busy, self.rates, now_s)
        candidates = [Candidate(node_ids[i], sources[node_ids[i]], waits[node_ids[i]])
                      for i in order]
        decision = decide(prompt, candidates, self.rates)
        self.recomputed += decision.recompute
        self.routed.record(request.keys, decision.replica_id, now_s)
        chosen = decision.chosen
        self.queue.routed(decision.replica_id, cluster.num_served,
                          chosen.fetch_s + chosen.prefill_s, now_s)
        return Route(cluster.index_of[decision.replica_id], decision.fetch_pages)


class PrefixAffinity:
    """A tree of what was routed where: key -> nodes, and each node's routed tokens."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.routed: dict[bytes, set[int]] = {}
        self.tree_tokens: list[int] | None = None

    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        num_nodes = len(cluster.nodes)
        if self.tree_tokens is None:
            self.tree_tokens = [0] * num_nodes
        queues = _queues(cluster, request.arrival_s)
        everyone = list(range(num_nodes))
        if max(queues) - min(queues) > RAY_IMBALANCED_THRESHOLD:
            node = _pow2(self.rng, everyone, queues)
        else:
            node = _pow2(self.rng, self._candidates(request), queues)
        self._insert(request, node)
        return node

    def _candidates(self, request: SimRequest) -> list[int]:
        matched = [0] * len(self.tree_tokens)
        alive = set(range(len(self.tree_tokens)))
        for key in request.keys:
            alive &= self.routed.get(key, set())
            if not alive:
                break
            for node in alive:
                matched[node] += 1
        best = max(matched)
        if best * BLOCK_TOKENS / max(1, request.input_tokens) >= RAY_MATCH_RATE_THRESHOLD:
            return [i for i, m in enumerate(matched) if m == best]
        smallest = min(self.tree_tokens)
        return [i for i, t in enumerate(self.tree_tokens) if t == smallest]

    def _insert(self, request: SimRequest, node: int) -> None:
        for key in request.keys:
            self.routed.setdefault(key, set()).add(node)
        self.tree_tokens[node] += request.input_tokens


class Dynamo:
    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        def cost(i: int) -> tuple[float, int]:
            overlap = cluster.nodes[i].local_prefix(request.keys)
            prefill_blocks = request.num_blocks - overlap
            active = cluster.queues[i].active_blocks(request.arrival_s)
            return DYNAMO_OVERLAP_WEIGHT * prefill_blocks + active, i

        return min(range(len(cluster.nodes)), key=cost)


class LlmD:
    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        queues = _queues(cluster, request.arrival_s)
        low, high = min(queues), max(queues)
        device = cluster.capacities[0]

        def score(i: int) -> tuple[float, int]:
            node = cluster.nodes[i]
            prefix = node.local_prefix(request.keys) / max(1, request.num_blocks)
            free = 1.0 - node.counts[0] / device if device else 0.0
            queue = (high - queues[i]) / (high - low) if high > low else 1.0
            total = (LLMD_WEIGHTS["prefix"] * prefix + LLMD_WEIGHTS["kv_utilisation"] * free
                     + LLMD_WEIGHTS["queue"] * queue)
            return total, -i

        return max(range(len(cluster.nodes)), key=score)


class PrefixMatch:
    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        queues = _queues(cluster, request.arrival_s)
        nodes = cluster.nodes
        return min(range(len(nodes)),
                   key=lambda i: (-nodes[i].local_prefix(request.keys), queues[i], i))


class Mooncake:
    """The least of queue estimate + transfer of the prefix it lacks + prefill. The queue
    estimate is the sum of the predicted times of the requests queued or running there, each
    counted whole (the conductor predicts each request's time from its length and prefix hit
    with a model fitted offline, here the profile's exact one; it is not told how far the
    running one has got), not the queue's exact remaining seconds."""

    def __call__(self, cluster: SimCluster, request: SimRequest, located) -> int:
        now_s = request.arrival_s
        queues = cluster.queues

        def ttft_s(i: int) -> tuple[float, int]:
            sources = cluster.plan(i, request.keys, located)
            return (queues[i].queued_service_s(now_s)
                    + cluster.service_s(sources, request.input_tokens), i)

        return min(range(len(cluster.nodes)), key=ttft_s)


def make_router(name: str, seed: int = 0) -> Choose:
    makers = {"raykv": lambda: Raykv(seed), "round_robin": RoundRobin,
              "pow2": lambda: Pow2(seed), "prefix_affinity": lambda: PrefixAffinity(seed),
              "dynamo": Dynamo, "llmd": LlmD, "mooncake": Mooncake,
              "prefix_match": PrefixMatch}
    if name not in makers:
        raise ValueError(f"unknown router {name!r}; expected one of {list(makers)}")
    return makers[name]()


ROUTERS = ("raykv", "round_robin", "pow2", "prefix_affinity", "dynamo", "llmd", "mooncake")
