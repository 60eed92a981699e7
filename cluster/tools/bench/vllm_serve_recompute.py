"""The recompute part of `raykv bench vllm-serve`: `recompute_decisions_correct`, the share of
routed requests where raykv's router chose the faster of fetching a cached prefix and
recomputing it, checked by running both, several times (issue 19).

Set-up: raykv's app (RaykvConnector, raykv's router) on the simulated cluster, with changes
that make the router's choice the only thing that differs between a probe's runs:
- one replica, on the head node of the simulated cluster: its vLLM engine-core process joins
  Ray as a driver, and a driver on a host of several raylets attaches to the head's, so its
  connector's raykv node is the head's (on a real cluster, a host's only raylet is the
  replica's own). There the pages a probe's prefix saved are on the replica's node, as the
  router must see them to weigh a fetch against a recompute, and every run of the probe
  reads them from there (`placement` in the JSON records where the replica ran and which
  node's tiers served the reads);
- vLLM's own prefix cache is off: a prompt's prefix is either loaded from raykv or recomputed;
- raykv's host tier holds HOST_PAGES pages, a little more than one prefix (a load goes
  through the host tier: a smaller one would cap every load at its size), with LRU eviction;
  before each run that must find the prefix on disk and may not (the first of each probe, any
  after a run that loaded it, which reads it up into the host tier), a flush request (a
  fresh HOST_PAGES-page prompt, recomputed) pushes the host tier's pages down to disk. It
  waits first for the last load's read lease to be let go (the client tells its node within
  touches.TOUCH_EVERY_S): pages a lease pins are not evicted, and a flush sent at once left
  the prefix in host for the next run (the first run of this part: forced fetches of the
  slowed disk in 45 ms, as from host, beside routed ones in 470 ms);
- the disk tier is made artificially slow in one condition: the node actors' test-only fault
  (cluster/core/faults.py, slow_disk: a sleep before every disk page read and write).

Per condition (CONDITIONS: the disk as it is; the disk slowed), NUM_PREFIXES prefixes of
PREFIX_PAGES pages are seeded (each sent once, recomputed: raykv saves its pages, and the next
seed pushes them to disk), then probed REPEATS times each, in rounds over the prefixes; a
probe's round sends three requests of the prefix and a fresh suffix shorter than a page, in
rotating order:
    routed     the router decides; its choice is read back from usage.prompt_tokens_details.
               cached_tokens (a fetch loads the prefix or its first pages: cached > 0; a
               recompute loads nothing)
    fetch      the cut forced to the whole prefix (kv_transfer_params FORCE_KEY)
    recompute  the cut forced to 0
Each routed run is one decision. It was right when it fetched and the probe's forced fetches
were faster than its forced recomputes (the medians of their TTFTs; max_tokens 1: the client's
time), or it recomputed and they were not. A probe counts only when every run succeeded, each
forced fetch loaded at least MIN_HELD_SHARE of the prefix (raykv held most of it) and no forced
recompute loaded anything (the force reached the engine); none counted: not exercised. What a
run loaded is what the connector reports its loads filled (LOADED_KEY in the response's
kv_transfer_params): vLLM's cached_tokens counts what a load was to fill, so a load cut at
its deadline, or short of pages, counted whole there.

The router weighs the rates the replica measured and publishes (cluster/serving/
engine_rates.py): its loads from each tier and its prefill rate, updated online. It learns a
slowed disk from the loads made under it (the forced fetches, its own fetches), so the slowed
condition's first decisions go by the disk as it was; `per_round` shows it.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from cluster.core.config import MiB
from cluster.core.trace_scale import ALPHABET, block_text
from cluster.serving.vllm_plan import FORCE_KEY, load_outcome_of
from cluster.touches import TOUCH_EVERY_S

KINDS = ("routed", "fetch", "recompute")
FORCED = {"routed": None, "fetch": 1 << 30, "recompute": 0}
# The disk as it is, and slowed: 20 ms before each page I/O (the faults benchmark's slow
# disk), about 30x what reading a 128 KiB page from the page cache takes here.
CONDITIONS = (("disk", None), ("slow-disk", 0.02))
NUM_PREFIXES = 10
REPEATS = 3
PREFIX_PAGES = 40
HOST_PAGES = 48  # raykv's host tier, in pages: one prefix and a little more
MIN_HELD_SHARE = 0.75  # of the prefix's pages, for a probe to count: raykv held most of it
DISK_BYTES = 512 * MiB
SUFFIX_CHARS = 8  # with the lead token, short of a page: every probe hits PREFIX_PAGES pages
SAVE_SETTLE_S = 3.0  # the seeds' saves reach raykv's tiers and its directory
FLUSH_SETTLE_S = 1.5  # a flush's save (and the demotions it makes) lands
RELEASE_WAIT_S = 2 * TOUCH_EVERY_S  # the last load's read lease reaches the node
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node
REQUEST_TIMEOUT_S = 120.0
FIRST_BLOCK = 1 << 40  # block texts from here on: none of the main part's trace blocks


@dataclass(frozen=True, slots=True)
class Run:
    """One request of a probe as the service answered it."""

    status: int
    ttft_ms: float
    cached_tokens: int
    # What raykv's loads filled, as the connector reports it (vllm_plan.LOADED_KEY; None: no
    # load was made, or the response did not say): vLLM's cached_tokens counts what a load
    # was to fill, and one cut short at its deadline still counts whole there.
    loaded_tokens: int | None = None

    @property
    def held_tokens(self) -> int:
        """The prefix tokens this run took from a cache: what raykv's loads filled where the
        connector said, else vLLM's count."""
        return self.cached_tokens if self.loaded_tokens is None else self.loaded_tokens


@dataclass(frozen=True, slots=True)
class Probe:
    """One prefix's runs under one condition: REPEATS of each kind (KINDS)."""

    condition: str
    prefix: int
    runs: dict  # kind -> list of Run, in the order sent
    prefix_tokens: int = PREFIX_PAGES * 32

    def why_not_counted(self) -> str:
        """Why this probe does not count ("" when it does)."""
        failed = sorted({k for k, runs in self.runs.items() for r in runs if r.status != 200})
        if failed:
            return f"failed: {failed}"
        held = min(r.held_tokens for r in self.runs["fetch"])
        if held < MIN_HELD_SHARE * self.prefix_tokens:
            return (f"a forced fetch loaded under {MIN_HELD_SHARE:.0%} of the prefix: raykv "
                    f"did not hold most of it")
        if any(r.cached_tokens > 0 or r.held_tokens > 0 for r in self.runs["recompute"]):
            return "a forced recompute loaded tokens: the force did not reach the engine"
        return ""

    def median_ms(self, kind: str) -> float:
        return statistics.median(r.ttft_ms for r in self.runs[kind])

    @property
    def fetch_faster(self) -> bool:
        return self.median_ms("fetch") < self.median_ms("recompute")

    def decisions(self) -> list[bool]:
        """Per routed run, whether it chose the faster ([] when the probe does not count)."""
        if self.why_not_counted():
            return []
        return [(r.cached_tokens > 0) == self.fetch_faster for r in self.runs["routed"]]


def correct_share(probes: Sequence[Probe]) -> float | None:
    """The share of counted decisions the router got right (None: none counted)."""
    verdicts = [v for p in probes for v in p.decisions()]
    return sum(verdicts) / len(verdicts) if verdicts else None


def summary(probes: Sequence[Probe]) -> dict:
    """Per condition and in all: probes and decisions counted, the router's fetches, the
    probes where the forced fetch was faster, the correct share, the medians' gap; and why
    probes were not counted."""
    out: dict = {}
    for condition in sorted({p.condition for p in probes}) + [None]:
        chosen = [p for p in probes if condition is None or p.condition == condition]
        counted = [p for p in chosen if not p.why_not_counted()]
        gaps = [abs(p.median_ms("fetch") - p.median_ms("recompute")) for p in counted]
        out[condition or "all"] = {
            "probes": len(chosen), "counted": len(counted),
            "decisions": sum(len(p.decisions()) for p in counted),
            "router_fetched": sum(r.cached_tokens > 0 for p in counted
                                  for r in p.runs["routed"]),
            "fetch_faster": sum(p.fetch_faster for p in counted),
            "correct_share": correct_share(chosen),
            "median_gap_ms": statistics.median(gaps) if gaps else None,
            "min_gap_ms": min(gaps) if gaps else None,
            "not_counted": sorted({w for p in chosen if (w := p.why_not_counted())})}
    return out


def per_round(probes: Sequence[Probe]) -> dict:
    """Per condition, per round of probes: the share of its decisions that were right (how
    the router's choices went as it measured the condition's rates)."""
    out: dict = {}
    for condition in sorted({p.condition for p in probes}):
        shares = []
        for index in range(REPEATS):
            verdicts = [p.decisions()[index] for p in probes
                        if p.condition == condition and len(p.decisions()) > index]
            shares.append(sum(verdicts) / len(verdicts) if verdicts else None)
        out[condition] = shares
    return out


def prefix_text(condition_index: int, prefix: int, page_tokens: int) -> str:
    """PREFIX_PAGES pages of text (trace_scale's block text: one character a token), distinct
    per condition and prefix, and from every trace block the main part replays."""
    first = FIRST_BLOCK + (condition_index * NUM_PREFIXES + prefix) * PREFIX_PAGES
    return "".join(block_text(first + i, page_tokens) for i in range(PREFIX_PAGES))


def flush_text(index: int, page_tokens: int) -> str:
    """A fresh HOST_PAGES-page prompt (the flush number `index`), after every prefix's."""
    first = FIRST_BLOCK + (len(CONDITIONS) * NUM_PREFIXES * PREFIX_PAGES
                           + index * HOST_PAGES)
    return "".join(block_text(first + i, page_tokens) for i in range(HOST_PAGES))


def suffix(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(SUFFIX_CHARS))


def rotated(index: int) -> tuple[str, ...]:
    """The order of KINDS in round `index` of a probe: each kind first, second and third
    equally often."""
    shift = index % len(KINDS)
    return KINDS[shift:] + KINDS[:shift]


# ---- the live part --------------------------------------------------------------------------


def send(url: str, model: str, prompt: str, forced: int | None) -> Run:
    """One completion, non-streamed with max_tokens 1 (its time is the TTFT), the cut forced
    where `forced` is not None."""
    import requests

    body: dict = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    if forced is not None:
        body["kv_transfer_params"] = {FORCE_KEY: forced}
    began_s = time.perf_counter()
    try:
        reply = requests.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException:
        return Run(0, (time.perf_counter() - began_s) * 1e3, 0)
    ttft_ms = (time.perf_counter() - began_s) * 1e3
    if reply.status_code != 200:
        return Run(reply.status_code, ttft_ms, 0)
    answer = reply.json()
    details = answer["usage"].get("prompt_tokens_details") or {}
    loaded_tokens, _ = load_outcome_of(answer.get("kv_transfer_params"))
    return Run(200, ttft_ms, details.get("cached_tokens") or 0, loaded_tokens)


def set_disk_delay(delay_s: float | None) -> list[dict]:
    """Every node actor's disk slowed by `delay_s` a page I/O (None: the fault cleared)."""
    import ray

    from actors.handles import NodeHandle
    from cluster.api import running_config

    config = running_config()
    described = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        handle = NodeHandle.lookup(node["NodeID"], config)
        if handle is None:
            continue
        ref = handle.inject_fault("clear") if delay_s is None \
            else handle.inject_fault("slow_disk", delay_s=delay_s)
        described.append(ray.get(ref, timeout=30))
    if not described:
        raise RuntimeError("no raykv node actor to slow the disk of")
    return described


@dataclass(slots=True)
class Prober:
    """Sends a condition's requests, flushing the host tier where a run may have left the
    probed prefix there (the module doc)."""

    url: str
    model: str
    page_tokens: int
    rng: random.Random
    num_flushes: int = 0
    host_dirty: bool = True  # the host tier may hold a probed prefix

    def run(self, text: str, kind: str) -> Run:
        if self.host_dirty:
            time.sleep(RELEASE_WAIT_S)
            send(self.url, self.model, flush_text(self.num_flushes, self.page_tokens), 0)
            self.num_flushes += 1
            time.sleep(FLUSH_SETTLE_S)
        result = send(self.url, self.model, text + suffix(self.rng), FORCED[kind])
        self.host_dirty = result.cached_tokens > 0 or result.status != 200
        return result


def probe_condition(prober: Prober, condition_index: int) -> list[Probe]:
    """One condition's seeds and probes (the disk's delay already set)."""
    condition = CONDITIONS[condition_index][0]
    page_tokens = prober.page_tokens
    prefixes = [prefix_text(condition_index, i, page_tokens) for i in range(NUM_PREFIXES)]
    for text in prefixes:
        send(prober.url, prober.model, text + suffix(prober.rng), 0)
    time.sleep(SAVE_SETTLE_S)
    prober.host_dirty = True
    runs: list[dict] = [{kind: [] for kind in KINDS} for _ in prefixes]
    for round_index in range(REPEATS):
        for index, text in enumerate(prefixes):
            for kind in rotated(round_index + index):
                runs[index][kind].append(prober.run(text, kind))
    return [Probe(condition, index, runs[index], PREFIX_PAGES * page_tokens)
            for index in range(len(prefixes))]


def probe_all(url: str, model: str, page_tokens: int,
              seed: int = 0) -> tuple[list[Probe], dict]:
    """Every condition's seeds and probes on the running app (see the module doc), and what
    the replica published of its rates at the end of each condition."""
    prober = Prober(url, model, page_tokens, random.Random(seed))
    probes: list[Probe] = []
    rates: dict = {}
    try:
        for condition_index, (condition, delay_s) in enumerate(CONDITIONS):
            set_disk_delay(delay_s)
            probes += probe_condition(prober, condition_index)
            rates[condition] = replica_rates()
    finally:
        set_disk_delay(None)
    return probes, rates


def replica_rates() -> dict:
    """What the part's replica publishes of its measured rates, as `raykv status` reads it
    (replica name -> its rates)."""
    from cluster.tools.rates_status import replica_rates as published

    return _recorded(published)


def placement() -> dict:
    """Where the part's replica ran (its node, and whether it is the head) and, per node,
    the pages its raykv tiers served (hits by tier)."""
    import ray
    from ray._private.state import actors

    from actors.handles import NodeHandle
    from cluster.api import running_config

    head = next((n["NodeID"] for n in ray.nodes()
                 if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})), None)
    replica = [(a.get("Address") or {}).get("NodeID") for a in actors().values()
               if a.get("State") == "ALIVE" and "RaykvLLMServer" in a.get("ActorClassName", "")]
    config, served = running_config(), {}
    for node in ray.nodes():
        handle = NodeHandle.lookup(node["NodeID"], config) if node.get("Alive") else None
        if handle is not None:
            stats = ray.get(handle.stats(), timeout=30)
            served[node["NodeID"][:12]] = {k: stats.get(k) for k in
                                           ("hits_host", "hits_disk", "pulled_pages")}
    return {"head": (head or "")[:12], "replica_nodes": [(n or "")[:12] for n in replica],
            "replica_on_head": bool(replica) and all(n == head for n in replica),
            "served_by_node": served}


def _recorded(figures) -> dict:
    """figures(), or what went wrong: a record for the JSON, never the part's failure."""
    try:
        return figures()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}


def print_summary(probes: Sequence[Probe]) -> None:
    from cluster.tools.bench.harness import print_tables, table

    rows = [[name, f"{row['counted']} of {row['probes']}", str(row["decisions"]),
             str(row["router_fetched"]), str(row["fetch_faster"]),
             "-" if row["correct_share"] is None else f"{row['correct_share']:.3f}",
             "-" if row["median_gap_ms"] is None else f"{row['median_gap_ms']:.0f}"]
            for name, row in summary(probes).items()]
    print_tables([table("recompute part", ["condition", "probes counted", "decisions",
                                           "router fetched", "forced fetch faster",
                                           "right", "median gap ms"], rows)])


def run_part(shape, model_dir: str, model: str, num_nodes: int, url: str,
             wait_ready, warm_up) -> dict:
    """A fresh raykv service and app (one replica, prefix caching off, a host tier of
    HOST_PAGES pages), probed under every condition; the app and service gone after.
    `num_nodes`: the cluster's (the replica runs on one of them)."""
    from ray import serve

    from cluster import start, stop
    from cluster.tools.bench.vllm_serve_setups import ENGINE_SLOT, raykv_app

    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-vllm-serve-recompute-", dir="/tmp")
    page_bytes = _page_bytes(model_dir, model, shape.block_tokens)
    try:
        start(_cache_config(shape, page_bytes, disk_dir))
        bundle = {"CPU": 1, ENGINE_SLOT: 1, HEAD_RESOURCE: 0.001}
        serve.run(raykv_app(model_dir, model, replace(shape, prefix_caching=False), 1, bundle),
                  name="recompute", route_prefix="/", blocking=False)
        wait_ready(url)
        warm_up(url)
        began_s = time.perf_counter()
        probes, rates = probe_all(url, model, shape.block_tokens)
        probe_s = time.perf_counter() - began_s
        print_summary(probes)
        return {"placement": _recorded(placement), "summary": summary(probes),
                "share": correct_share(probes), "per_round": per_round(probes),
                "rates_after": rates,
                "probe_s": probe_s,
                "probes": [_probe_record(p) for p in probes],
                "conditions": [list(c) for c in CONDITIONS], "page_bytes": page_bytes,
                "host_pages": HOST_PAGES, "prefix_pages": PREFIX_PAGES,
                "num_prefixes": NUM_PREFIXES, "repeats": REPEATS, "replicas": 1,
                "cluster_nodes": num_nodes}
    finally:
        serve.delete("recompute")
        stop()
        shutil.rmtree(disk_dir, ignore_errors=True)


def _cache_config(shape, page_bytes: int, disk_dir: str):
    """The service's: a host tier of HOST_PAGES pages, LRU, and a disk tier."""
    from cluster import CacheConfig

    return CacheConfig(page_tokens=shape.block_tokens, device_bytes=0,
                       host_bytes=HOST_PAGES * page_bytes, eviction="lru",
                       disk_bytes=DISK_BYTES, disk_dir=disk_dir, disk_codec="none")


def _probe_record(p) -> dict:
    """One probe in the JSON: its decisions, medians and every run."""
    return {"condition": p.condition, "prefix": p.prefix,
            "decisions": p.decisions(), "why_not_counted": p.why_not_counted(),
            "median_ms": {k: p.median_ms(k) for k in KINDS},
            "runs": {k: [asdict(r) for r in runs] for k, runs in p.runs.items()}}


def _page_bytes(model_dir: str, model: str, page_tokens: int) -> int:
    """A page's bytes for the model at `model_dir` (float32), as raykv's router keys it."""
    from cluster.core.spec import ModelSpec
    from cluster.serving.vllm_app import router_settings

    _, kwargs = router_settings("raykv", model_dir, model, "default", "float32", page_tokens)
    return ModelSpec(**kwargs["prompt_keys"]["spec"]).page_bytes(page_tokens)
