"""Cost-based routing: send a request to the replica with the least estimated time to first
token, and fetch only the part of its cached prefix that is cheaper to fetch than to recompute.

Pure: the live router (cluster/serving/router.py) and the simulator's (cluster/core/
sim_routers.py) feed it, per candidate replica, where it could read each page of the prompt's
cached prefix from (its engine's own blocks, its node's device, host or disk tier, or another
node) and its queue wait; and the rates, measured online (`observe_*` below).

    ttft(replica) = queue wait
                  + min over k in 0..n of  fetch(pages[:k]) + prefill(tokens - k * page_tokens)

    fetch(pages)  = sum over the sources used: latency + pages' bytes / the source's bytes/s
    prefill(c, n) = (n - c) / the replica's prefill tokens/s
                  + (n^2 - c^2) x seconds per token pair of attention
                    (prefilling positions c..n of a prompt of n tokens, c of them cached: the
                    causal attention of each new token over the ones before it)

Prefill is not linear in the tokens: each new token attends to every token before it, so the
last thousand tokens of a long prompt cost more than its first thousand. A router that prices
prefill at one tokens/s under-prices long prompts and the tail of a cut (the Mooncake
conductor fits the same two terms offline); raykv's engines fit both online
(cluster/serving/prefill_fit.py).

An engine loads a prefix, then prefills the rest (a connector's lookup answers one token
count), so the choice is a cut k: fetch the first k pages, recompute the others. A page behind
a slow tier is recomputed when fetching it costs more than prefilling it; no hand-set
threshold: the cut moves exactly where fetch time and recompute time cross (ties recompute:
a fetch is made only when it is faster).

Rates are exponentially weighted moving averages of what transfers and prefills took. They
average seconds per byte (and per token), not bytes per second: a time estimate is bytes x
seconds per byte, and the mean of the inverse rates is what makes it unbiased. The priors are
optimistic about fetches, so a path is tried, and measured, before it can be judged slower
than recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

ENGINE, DEVICE, HOST, DISK, REMOTE = "engine", "device", "host", "disk", "remote"
SOURCES = (ENGINE, DEVICE, HOST, DISK, REMOTE)  # best first, as a replica reads them
TIER_SOURCES = {0: DEVICE, 1: HOST, 2: DISK}  # the tiers' numbers (policies.routing)
SAMPLE_WEIGHT = 0.2  # an EWMA's weight on a new sample: about the last 5 dominate
GB = 10**9
# Priors before anything is measured: the figures of these machines (docs: DESIGN.md),
# rounded up: memcpy-class for the node's own tiers, a loopback socket for another node.
PRIOR_PATHS = {ENGINE: (float("inf"), 0.0), DEVICE: (20 * GB, 0.0), HOST: (6 * GB, 0.0),
               DISK: (2.5 * GB, 0.0), REMOTE: (1.8 * GB, 0.0)}
PRIOR_PREFILL_TOKENS_PER_S = 2_000.0  # a small model on a few CPU cores
PREFILL_ATTENTION = "prefill_attention_s_per_pair"  # a replica's published fit of it


@dataclass(frozen=True, slots=True)
class PathRate:
    """One fetch path: its bytes/s (from an EWMA of seconds per byte) and a fixed latency per
    transfer: a prior, or an EWMA of fixed parts measured apart (`observed`'s `fixed_s`). One
    transfer's total time cannot tell latency from bandwidth; taken as bytes' time, the
    fixed part of a one-page load priced a fetch of 22 pages from this node's host tier at 228 ms,
    19x the same pages from another node (docs/benchmarks.md, vllm-serve: what a load's
    fixed part cost)."""

    bytes_per_s: float
    latency_s: float = 0.0
    num_samples: int = 0

    def seconds(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bytes_per_s

    def observed(self, num_bytes: int, seconds: float, fixed_s: float | None = None
                 ) -> PathRate:
        """This path after a transfer of `num_bytes` that took `seconds`; the EWMA is of
        seconds per byte. `fixed_s`: the part of `seconds` measured as the transfer's fixed
        cost (a vLLM load's time outside its raykv reads: the directory's answer, the
        hand-off), a sample of the latency, whose EWMA it joins; the rest is the bytes'. None:
        not measured, and the latency estimate is taken off instead. Nothing learnt from an
        empty or untimed transfer."""
        latency_s = self.latency_s
        if fixed_s is not None:
            fixed_s = min(max(0.0, fixed_s), seconds)
            latency_s = ewma(self.latency_s, fixed_s, self.num_samples)
        moving_s = seconds - (self.latency_s if fixed_s is None else fixed_s)
        if num_bytes <= 0 or moving_s <= 0:
            return self
        per_byte_s = ewma(1.0 / self.bytes_per_s, moving_s / num_bytes, self.num_samples)
        return replace(self, bytes_per_s=1.0 / per_byte_s, latency_s=latency_s,
                       num_samples=self.num_samples + 1)

    def at_least(self, num_bytes: int, seconds: float) -> PathRate:
        """This path after a transfer of `num_bytes` that was cut at `seconds` (a deadline):
        it would have taken longer, so the estimate for those bytes is raised to at least
        `seconds` at once. A bound is not a sample: blended into the EWMA it would leave the
        estimate below it, and the next transfer of that size would be tried, and cut, again."""
        moving_s = seconds - self.latency_s
        if num_bytes <= 0 or moving_s <= 0 or self.seconds(num_bytes) >= seconds:
            return self
        return replace(self, bytes_per_s=num_bytes / moving_s, num_samples=self.num_samples + 1)


@dataclass(frozen=True, slots=True)
class RateEstimates:
    """Every fetch path's rate (`SOURCES`) and each replica's prefill tokens/s;
    `prior_prefill_tokens_per_s` is the rate of a replica without one of its own: the prior,
    or in a router's estimates the replicas' pooled rate (`pooled`)."""

    paths: Mapping[str, PathRate]
    prefill_tokens_per_s: Mapping[str, float] = field(default_factory=dict)
    prior_prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    prefill_samples: Mapping[str, int] = field(default_factory=dict)
    # Seconds per token pair of prefill attention (module doc), one for the deployment: the
    # replicas run one model. 0 until an engine has measured it (prefill is then linear).
    attention_s_per_pair: float = 0.0

    def prefill_s(self, prompt: Prompt, cached_pages: int, replica_id: str) -> float:
        """`prefill_s` at the replica's rate and the attention term."""
        return prefill_s(prompt, cached_pages, self.prefill_rate(replica_id),
                         self.attention_s_per_pair)

    def prefill_rate(self, replica_id: str) -> float:
        """The replica's measured rate; before its first prefill, the mean of the others'
        (replicas of one deployment run one model), else the prior."""
        if replica_id in self.prefill_tokens_per_s:
            return self.prefill_tokens_per_s[replica_id]
        known = list(self.prefill_tokens_per_s.values())
        return _harmonic_mean(known) if known else self.prior_prefill_tokens_per_s

    def as_dict(self) -> dict:
        """For `raykv status` and JSON: bytes/s, latency and samples per path; tokens/s and
        samples per replica."""
        return {"paths": {name: {"bytes_per_s": p.bytes_per_s, "latency_s": p.latency_s,
                                 "num_samples": p.num_samples}
                          for name, p in self.paths.items()},
                "prefill_tokens_per_s": dict(self.prefill_tokens_per_s),
                "prefill_samples": dict(self.prefill_samples),
                "prefill_default_tokens_per_s": self.prior_prefill_tokens_per_s,
                "attention_s_per_pair": self.attention_s_per_pair}


def prior_rates(paths: Mapping[str, tuple[float, float]] | None = None,
                prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S,
                attention_s_per_pair: float = 0.0) -> RateEstimates:
    """Estimates before any measurement: `paths` is source -> (bytes/s, latency_s)."""
    table = {**PRIOR_PATHS, **(paths or {})}
    return RateEstimates({name: PathRate(bw, latency_s) for name, (bw, latency_s)
                          in table.items()}, {}, prefill_tokens_per_s,
                         attention_s_per_pair=attention_s_per_pair)


def ewma(old: float, sample: float, num_samples: int) -> float:
    """One step of the measured rates' EWMA (SAMPLE_WEIGHT) after `num_samples` samples."""
    # The first sample replaces the prior outright: a measurement beats a guess.
    return sample if num_samples == 0 else (1 - SAMPLE_WEIGHT) * old + SAMPLE_WEIGHT * sample


def _harmonic_mean(rates: Sequence[float]) -> float:
    return len(rates) / sum(1.0 / r for r in rates)


def observe_transfer(rates: RateEstimates, source: str, num_bytes: int,
                     seconds: float, fixed_s: float | None = None) -> RateEstimates:
    """Rates after a transfer of `num_bytes` from `source` that took `seconds`, `fixed_s` of
    them its measured fixed cost (PathRate.observed)."""
    path = rates.paths[source]
    updated = path.observed(num_bytes, seconds, fixed_s)
    if updated is path:
        return rates
    return replace(rates, paths={**rates.paths, source: updated})


def observe_prefill(rates: RateEstimates, replica_id: str, num_tokens: int,
                    seconds: float) -> RateEstimates:
    """Rates after `replica_id` prefilled `num_tokens` in `seconds`."""
    if num_tokens <= 0 or seconds <= 0:
        return rates
    count = rates.prefill_samples.get(replica_id, 0)
    old = rates.prefill_tokens_per_s.get(replica_id, rates.prior_prefill_tokens_per_s)
    per_token_s = ewma(1.0 / old, seconds / num_tokens, count)
    return replace(rates,
                   prefill_tokens_per_s={**rates.prefill_tokens_per_s,
                                         replica_id: 1.0 / per_token_s},
                   prefill_samples={**rates.prefill_samples, replica_id: count + 1})


def merge_paths(rates: RateEstimates, measured: Iterable[Mapping[str, PathRate]]
                ) -> RateEstimates:
    """The paths as several replicas measured them, pooled: per source the sample-weighted
    means of seconds per byte and of latency; a source nobody measured keeps `rates`'
    value."""
    sums: dict[str, list[float]] = {}
    for paths in measured:
        for name, path in paths.items():
            if path.num_samples:
                total = sums.setdefault(name, [0.0, 0.0, 0.0])
                total[0] += path.num_samples / path.bytes_per_s
                total[1] += path.num_samples * path.latency_s
                total[2] += path.num_samples
    merged = dict(rates.paths)
    for name, (weighted_s, weighted_latency_s, count) in sums.items():
        base = merged.get(name, PathRate(1.0))
        merged[name] = replace(base, bytes_per_s=count / weighted_s,
                               latency_s=weighted_latency_s / count, num_samples=int(count))
    return replace(rates, paths=merged)


def published(rates: RateEstimates, replica_id: str) -> dict:
    """What a replica tells routers of its measurements (small, JSON-able): the paths it
    measured, and its own prefill rate when it has one."""
    out: dict = {"paths": {name: [p.bytes_per_s, p.latency_s, p.num_samples]
                           for name, p in rates.paths.items() if p.num_samples}}
    if replica_id in rates.prefill_tokens_per_s:
        out["prefill_tokens_per_s"] = rates.prefill_tokens_per_s[replica_id]
        out["prefill_samples"] = rates.prefill_samples[replica_id]
    return out


def pooled(prior: RateEstimates, by_replica: Mapping[str, Mapping]) -> RateEstimates:
    """The router's estimates from what each replica published (`published`): the paths
    pooled over replicas (`merge_paths`), and the prefill rate pooled over them too (the
    sample-weighted mean of their seconds per token), which every replica is estimated at.

    A deployment's replicas run one model. One replica's own rate, an EWMA over its last few
    steps on a shared machine, can be off several-fold; a replica estimated slower is then
    sent nothing while its queue is no longer than the others' (most of the time at moderate
    load), so it is never measured again and its figure never mends: the live benchmark's
    router sent one replica of three nothing, and another 72% of a round, on rates that
    differed 7x between identical engines (docs/benchmarks.md, vllm-serve). Pooled, a noisy
    step moves every replica's estimate alike; replicas differ by what they hold and their
    queues (a slower replica's compute seconds per request lengthen its queue wait)."""
    paths = [{name: PathRate(*row) for name, row in (stats.get("paths") or {}).items()
              if name in prior.paths} for stats in by_replica.values()]
    rates = merge_paths(prior, paths)
    own = [(stats["prefill_tokens_per_s"], max(1, int(stats.get("prefill_samples", 1))))
           for stats in by_replica.values() if stats.get("prefill_tokens_per_s")]
    if not own:
        return replace(rates, prefill_tokens_per_s={}, prefill_samples={})
    num_samples = sum(count for _, count in own)
    per_token_s = sum(count / tokens_per_s for tokens_per_s, count in own) / num_samples
    return replace(rates, prefill_tokens_per_s={}, prefill_samples={},
                   prior_prefill_tokens_per_s=1.0 / per_token_s,
                   attention_s_per_pair=_pooled_attention(by_replica.values(),
                                                          prior.attention_s_per_pair))


def _pooled_attention(stats: Iterable[Mapping], default: float) -> float:
    """The sample-weighted mean of the attention seconds per pair that replicas published
    (PREFILL_ATTENTION); `default` when none did."""
    own = [(float(one[PREFILL_ATTENTION]), max(1, int(one.get("prefill_samples", 1))))
           for one in stats if one.get(PREFILL_ATTENTION) is not None
           and one[PREFILL_ATTENTION] >= 0]
    if not own:
        return default
    return sum(value * count for value, count in own) / sum(count for _, count in own)


def queued_requests(reported: int | None, routed_in_flight: int) -> int:
    """The requests ahead of a new one at a replica: what Serve's queue-length cache last
    heard (None: it keeps none, which is Serve's default without strict max_ongoing_requests),
    or the requests this router sent there that have not finished, whichever is more (the
    cache, where kept, already counts this router's sends; the router's own count is a lower
    bound where other routers send too). Without the router's own count, an empty cache reads
    every replica as idle, locality decides every request and the replicas holding prefixes
    take all the load."""
    return max(reported or 0, routed_in_flight)


@dataclass(frozen=True, slots=True)
class Prompt:
    """The request, as costs see it: its tokens and its pages' size."""

    num_tokens: int
    page_tokens: int
    page_bytes: int


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that could serve the prompt: per page of the cached prefix, in order, the
    best source it can read that page from; and how long its queue would make it wait."""

    replica_id: str
    sources: tuple[str, ...]
    queue_wait_s: float


@dataclass(frozen=True, slots=True)
class Estimate:
    replica_id: str
    ttft_s: float
    fetch_pages: int  # the cut: fetch pages [0, fetch_pages), recompute the rest
    fetch_s: float
    prefill_s: float
    queue_wait_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """Where the request goes and how much of its cached prefix that replica fetches."""

    replica_id: str
    fetch_pages: int
    num_cached_pages: int  # of the chosen replica's prefix: pages it could fetch
    estimates: tuple[Estimate, ...]

    @property
    def recompute(self) -> bool:
        """The connector is to recompute cached pages (fetching them costs more)."""
        return self.fetch_pages < self.num_cached_pages

    @property
    def chosen(self) -> Estimate:
        return next(e for e in self.estimates if e.replica_id == self.replica_id)


def prefill_s(prompt: Prompt, cached_pages: int, tokens_per_s: float,
              attention_s_per_pair: float = 0.0) -> float:
    """Prefill of what `cached_pages` leave (module doc: the tokens at `tokens_per_s` and
    their attention at `attention_s_per_pair`); at least one token, whose logits start
    decoding."""
    num_tokens = prompt.num_tokens
    cached_tokens = min(cached_pages * prompt.page_tokens, max(0, num_tokens - 1))
    return ((num_tokens - cached_tokens) / tokens_per_s
            + attention_s_per_pair * (num_tokens * num_tokens - cached_tokens * cached_tokens))


def estimate_ttft(candidate: Candidate, prompt: Prompt, rates: RateEstimates) -> Estimate:
    """The candidate's TTFT at its best cut (see the module doc); the smallest cut of the
    least cost, so a fetch is made only where it is strictly faster."""
    best_k, best_fetch_s, best_s = _best_cut(candidate.sources, prompt, rates,
                                             rates.prefill_rate(candidate.replica_id))
    return Estimate(candidate.replica_id, candidate.queue_wait_s + best_s, best_k,
                    best_fetch_s, best_s - best_fetch_s, candidate.queue_wait_s)


def _best_cut(sources: tuple[str, ...], prompt: Prompt, rates: RateEstimates,
              tokens_per_s: float) -> tuple[int, float, float]:
    """(k, fetch seconds, fetch + prefill seconds) of the least-cost cut. The arithmetic is
    `prefill_s`'s, inlined: this loop runs per page per candidate on the router's path (and
    dominated the simulator's time)."""
    page_tokens, num_tokens = prompt.page_tokens, prompt.num_tokens
    usable = min(len(sources), max(0, num_tokens - 1) // page_tokens)
    attention_s = rates.attention_s_per_pair
    best_k, best_fetch_s = 0, 0.0
    best_s = prefill_s(prompt, 0, tokens_per_s, attention_s)
    all_pairs = num_tokens * num_tokens
    fetch_s, used = 0.0, set()
    paths = rates.paths
    for k in range(1, usable + 1):
        source = sources[k - 1]
        path = paths[source]
        fetch_s += prompt.page_bytes / path.bytes_per_s
        if source not in used:
            used.add(source)
            fetch_s += path.latency_s
        # k <= usable, so k pages of tokens stay below num_tokens: prefill_s's min is k's.
        cached = k * page_tokens
        total_s = (fetch_s + (num_tokens - cached) / tokens_per_s
                   + attention_s * (all_pairs - cached * cached))
        if total_s < best_s:
            best_k, best_fetch_s, best_s = k, fetch_s, total_s
    return best_k, best_fetch_s, best_s


def decide(prompt: Prompt, candidates: Sequence[Candidate], rates: RateEstimates
           ) -> Decision | None:
    """The candidate of the least estimated TTFT (the first of equals: callers order
    candidates to break ties), with its fetch-or-recompute cut. None without candidates."""
    if not candidates:
        return None
    # Candidates that read the same sources at the same prefill rate share their cut (on a
    # large cluster most read every page from another node): compute it once.
    cuts: dict[tuple[tuple[str, ...], float], tuple[int, float, float]] = {}
    estimates = []
    for c in candidates:
        tokens_per_s = rates.prefill_rate(c.replica_id)
        cut = cuts.get((c.sources, tokens_per_s))
        if cut is None:
            cut = cuts[(c.sources, tokens_per_s)] = _best_cut(c.sources, prompt, rates,
                                                              tokens_per_s)
        best_k, best_fetch_s, best_s = cut
        estimates.append(Estimate(c.replica_id, c.queue_wait_s + best_s, best_k,
                                  best_fetch_s, best_s - best_fetch_s, c.queue_wait_s))
    best = min(range(len(estimates)), key=lambda i: estimates[i].ttft_s)
    usable = max(0, prompt.num_tokens - 1) // prompt.page_tokens
    return Decision(estimates[best].replica_id, estimates[best].fetch_pages,
                    min(len(candidates[best].sources), usable), tuple(estimates))


def best_sources(located: Sequence[Iterable[tuple[str, int]]], node_ids: Iterable[str],
                 engine_pages: Mapping[str, int] | None = None) -> dict[str, tuple[str, ...]]:
    """Per node, per page of a directory's answer ((node, tier) places per page of the
    longest cached prefix), the best source a replica there reads it from: its engine's own
    blocks for its first `engine_pages[node]`, else its node's best tier, else another node.
    One pass over the answer, whatever the number of nodes."""
    engine_pages = engine_pages or {}
    nodes = list(node_ids)
    num_pages = len(located)
    # Every page defaults to another node; only the places the answer names change that.
    sources: dict[str, list[str]] = {node: [REMOTE] * num_pages for node in nodes}
    best: dict[str, int] = {}
    last = None
    for index, places in enumerate(located):
        if places is not last:  # a run's pages share one answer (prefix_runs): once a run
            last, best = places, {}
            for node, tier in places:
                if tier in TIER_SOURCES and tier < best.get(node, len(TIER_SOURCES)):
                    best[node] = tier
        for node, tier in best.items():
            if node in sources:
                sources[node][index] = TIER_SOURCES[tier]
    for node, count in engine_pages.items():
        if node in sources and count > 0:
            held = sources[node]
            held[: min(count, num_pages)] = [ENGINE] * min(count, num_pages)
            held.extend([ENGINE] * (count - num_pages))
    return {node: tuple(s) for node, s in sources.items()}
