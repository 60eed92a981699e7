"""The recompute part of `raykv bench vllm-serve`: `recompute_decisions_correct`, the share of
requests where raykv's router chose the faster of fetching a cached prefix and recomputing it,
checked by running both (issue 19).

Set-up: raykv's app (RaykvConnector, raykv's router) on the 3 simulated nodes, as in the main
part, with two changes that make the router's choice the only thing that differs:
- vLLM's own prefix cache is off: a prompt's prefix is either loaded from raykv or recomputed
  (no engine's own blocks answer for it, whichever replica runs it);
- raykv's host tier is small (HOST_PAGES pages a node), so the seeded prefixes lie mostly on
  the disk tier, the tier made artificially slow: the node actors' test-only fault
  (cluster/core/faults.py, slow_disk: a sleep before every disk page read and write).

Per condition (CONDITIONS: the disk as it is; the disk slowed), NUM_PREFIXES prefixes of
PREFIX_PAGES pages each are seeded (the prefix alone, sent once: raykv saves its pages), then
each is probed with three requests of the prefix and a fresh suffix shorter than a page, in
rotating order:
    routed     the router decides; its choice is read back from usage.prompt_tokens_details.
               cached_tokens (a fetch loads part of the prefix: cached > 0; a recompute loads
               nothing)
    fetch      the cut forced to the whole prefix (kv_transfer_params FORCE_KEY)
    recompute  the cut forced to 0
The router chose right when it fetched and the forced fetch's TTFT (max_tokens 1: the client's
time) was below the forced recompute's, or it recomputed and the recompute was not slower. A
probe whose forced fetch loaded nothing (raykv held none of the prefix) or whose forced
recompute loaded something (the force did not reach the engine), or any of whose requests
failed, is not counted; none counted: the ratio is not exercised.

The router weighs the rates it knows: measured ones where replicas publish them, else the
priors (policies/cost_routing.py). vLLM replicas publish none yet, so under a slowed disk the
router goes by the priors' disk rate, and this part says how often that was right.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from cluster.core.config import MiB
from cluster.core.trace_scale import ALPHABET, block_text
from cluster.serving.vllm_plan import FORCE_KEY

KINDS = ("routed", "fetch", "recompute")
FORCED = {"routed": None, "fetch": 1 << 30, "recompute": 0}
# The disk as it is, and slowed: 20 ms before each page I/O (the faults benchmark's slow
# disk), about 30x what reading a 128 KiB page from the page cache takes here.
CONDITIONS = (("disk", None), ("slow-disk", 0.02))
NUM_PREFIXES = 6
PREFIX_PAGES = 40
HOST_PAGES = 8  # raykv's host tier per node, in pages: the seeded prefixes spill to disk
DISK_BYTES = 64 * MiB
SUFFIX_CHARS = 8  # with the lead token, short of a page: every probe hits PREFIX_PAGES pages
SAVE_SETTLE_S = 3.0  # the seeds' saves reach raykv's tiers and its directory
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Run:
    """One request of a probe as the service answered it."""

    status: int
    ttft_ms: float
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Probe:
    """One prefix's three requests (KINDS) under one condition."""

    condition: str
    prefix: int
    order: tuple[str, ...]
    runs: dict  # kind -> Run

    def why_not_counted(self) -> str:
        """Why this probe does not count ("" when it does)."""
        failed = [k for k, r in self.runs.items() if r.status != 200]
        if failed:
            return f"failed: {failed}"
        if self.runs["fetch"].cached_tokens <= 0:
            return "the forced fetch loaded nothing: raykv held none of the prefix"
        if self.runs["recompute"].cached_tokens > 0:
            return "the forced recompute loaded tokens: the force did not reach the engine"
        return ""

    @property
    def router_fetched(self) -> bool:
        return self.runs["routed"].cached_tokens > 0

    @property
    def fetch_faster(self) -> bool:
        return self.runs["fetch"].ttft_ms < self.runs["recompute"].ttft_ms

    def correct(self) -> bool | None:
        """Whether the router chose the faster (None: the probe does not count)."""
        if self.why_not_counted():
            return None
        return self.router_fetched == self.fetch_faster


def correct_share(probes: Sequence[Probe]) -> float | None:
    """The share of counted probes the router chose right (None: none counted)."""
    verdicts = [v for v in (p.correct() for p in probes) if v is not None]
    return sum(verdicts) / len(verdicts) if verdicts else None


def summary(probes: Sequence[Probe]) -> dict:
    """Per condition and in all: probes counted, the router's fetches, the forced fetch's
    wins, the correct share; and why probes were not counted."""
    out: dict = {}
    for condition in sorted({p.condition for p in probes}) + [None]:
        chosen = [p for p in probes if condition is None or p.condition == condition]
        counted = [p for p in chosen if p.correct() is not None]
        out[condition or "all"] = {
            "probes": len(chosen), "counted": len(counted),
            "router_fetched": sum(p.router_fetched for p in counted),
            "fetch_faster": sum(p.fetch_faster for p in counted),
            "correct_share": correct_share(chosen),
            "not_counted": sorted({w for p in chosen if (w := p.why_not_counted())})}
    return out


def prefix_text(condition_index: int, prefix: int, page_tokens: int) -> str:
    """PREFIX_PAGES pages of text (trace_scale's block text: one character a token), distinct
    per condition and prefix, and from every trace block the main part replays."""
    first = (1 << 40) + (condition_index * NUM_PREFIXES + prefix) * PREFIX_PAGES
    return "".join(block_text(first + i, page_tokens) for i in range(PREFIX_PAGES))


def suffix(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(SUFFIX_CHARS))


def rotated(index: int) -> tuple[str, ...]:
    """The probe's order of KINDS: each kind first, second and third equally often."""
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
    details = reply.json()["usage"].get("prompt_tokens_details") or {}
    return Run(200, ttft_ms, details.get("cached_tokens") or 0)


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


def probe_all(url: str, model: str, page_tokens: int, seed: int = 0) -> list[Probe]:
    """Every condition's seeds and probes on the running app (see the module doc)."""
    rng = random.Random(seed)
    probes: list[Probe] = []
    for condition_index, (condition, delay_s) in enumerate(CONDITIONS):
        set_disk_delay(delay_s)
        prefixes = [prefix_text(condition_index, i, page_tokens) for i in range(NUM_PREFIXES)]
        for text in prefixes:
            send(url, model, text + suffix(rng), 0)
        time.sleep(SAVE_SETTLE_S)
        for index, text in enumerate(prefixes):
            order = rotated(index)
            runs = {kind: send(url, model, text + suffix(rng), FORCED[kind]) for kind in order}
            probes.append(Probe(condition, index, order, runs))
    set_disk_delay(None)
    return probes


def run_part(shape, model_dir: str, model: str, num_nodes: int, url: str,
             wait_ready, warm_up) -> dict:
    """A fresh raykv service and app (prefix caching off, a small host tier), probed under
    every condition; the app and service gone after."""
    from ray import serve

    from cluster import CacheConfig, start, stop
    from cluster.tools.bench.vllm_serve_setups import raykv_app

    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-vllm-serve-recompute-", dir="/tmp")
    page_bytes = _page_bytes(model_dir, model, shape.block_tokens)
    try:
        start(CacheConfig(page_tokens=shape.block_tokens, device_bytes=0,
                          host_bytes=HOST_PAGES * page_bytes,
                          disk_bytes=DISK_BYTES, disk_dir=disk_dir, disk_codec="none"))
        serve.run(raykv_app(model_dir, model, replace(shape, prefix_caching=False), num_nodes),
                  name="recompute", route_prefix="/", blocking=False)
        wait_ready(url)
        warm_up(url)
        probes = probe_all(url, model, shape.block_tokens)
        return {"summary": summary(probes), "share": correct_share(probes),
                "probes": [{"condition": p.condition, "prefix": p.prefix, "order": p.order,
                            "correct": p.correct(), "why_not_counted": p.why_not_counted(),
                            "runs": {k: asdict(r) for k, r in p.runs.items()}}
                           for p in probes],
                "conditions": [list(c) for c in CONDITIONS], "page_bytes": page_bytes,
                "host_pages": HOST_PAGES, "prefix_pages": PREFIX_PAGES}
    finally:
        serve.delete("recompute")
        stop()
        shutil.rmtree(disk_dir, ignore_errors=True)


def _page_bytes(model_dir: str, model: str, page_tokens: int) -> int:
    """A page's bytes for the model at `model_dir` (float32), as raykv's router keys it."""
    from cluster.core.spec import ModelSpec
    from cluster.serving.vllm_app import router_settings

    _, kwargs = router_settings("raykv", model_dir, model, "default", "float32", page_tokens)
    return ModelSpec(**kwargs["prompt_keys"]["spec"]).page_bytes(page_tokens)
