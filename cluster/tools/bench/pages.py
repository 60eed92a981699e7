"""`raykv bench pages`: what a get and a put cost per page, for small and large pages.

Pages of 16, 64 and 256 tokens (--quick: 16), requests of 256 to 32,768 tokens (--quick: 256,
4,096 and 32,768), the KV geometry of Llama-3.1-8B (common.LLAMA_8B_KV: 32 layers, 8 kv heads,
head_dim 128, bf16: 2 x 32 x 8 x 128 x 2 B = 128 KiB per token) with its layers scaled down by
a power of two until the run fits the machine's memory (fit_plan; the JSON says how far). For
each page size one service runs; batch 0 (the largest request) is put once and every get
reads a prefix of it. Per request size, every contender runs once a round in rotating order
(harness.interleave); a figure is the median of `reps` calls:

    memcpy_get  copies.copy_pages (the routine and threads client.get copies with) from the
                host-tier slots of the request's pages into out's page slices, one block per
                run of consecutive slots as the get copies them (fetch.copy_pairs): its bytes
    get         reader.get(tokens, out=out) by a second client (`reader`, connected apart:
                it did not put the pages), its notes of them dropped before each: the node's
                held-pages index (tiers/held_index.py) says where they are, the copies, the
                generation check; no call (the node hears of the reads, and the directory of
                the request's demand, in batches afterwards): a replica's first get of a
                prefix another replica put
    acquire_get the same get with the index left unread: the node's acquire (one call; the
                node holds the whole prefix, so the directory is not asked on the path), the
                copies, the release (what `get` was before the index; tiers' cold_get)
    warm_get    the same get right after another: copies from the noted slots, no call
    noop        a no-op call to the node actor (ping), awaited as the client awaits its calls
    own_get     `get` with its copy made a no-op (fetch._copy_places swapped for one that
                makes the blocks but copies nothing): the get's own work, back to back, so
                with warm CPU caches. A phase timing, not a contender: on a GPU node the copy
                is a DMA that leaves the CPU's caches alone, and this is the get's CPU time
    own_get_after_copy  the same, each call right after an untimed memcpy of the request's
                bytes (memcpy_put's), as a get follows the copy of the get before it on this
                CPU-only machine: the caches the get's work runs in are emptied first
    memcpy_put  copies.copy_pages from kv's page slices into one private buffer of pages, one
                block, as the put copies a run of consecutive reserved slots
    put         client.put of fresh tokens: copies into slots the client's lease holds, no
                call (cluster/puts.py; its background commit, which also tops the lease up, is
                waited for afterwards, untimed); a put that finds too few leased slots reserves
                and commits (two calls). The pages are discarded afterwards, untimed, so that
                the next put finds room

Ratios (contract), at 16-token pages (vLLM's block size), each the median of per-round values:
    small_page_overhead_us       (get - memcpy_get) / pages, at 4,096 tokens        (<= 5)
    get_256_tokens_vs_noop_call  get / noop, at 256 tokens                          (<= 1.5)
    get_32k_tokens_vs_memcpy     memcpy_get / get (as rates), at 32,768 tokens      (>= 0.8)
With no goal, beside them: small_page_own_work_us (own_get / pages at 4,096 tokens),
small_page_own_work_after_copy_us (own_get_after_copy's), small_page_copy_excess_us ((get -
own_get_after_copy - memcpy_get) / pages: what the copy inside the get costs above the
memcpy alone, with the round's noise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import ray
import torch

from cluster import fetch
from cluster.calls import Wait, Work, run_sync
from cluster.core.config import CacheConfig
from cluster.core.copies import COPY_THREADS, copy_pages
from cluster.core.kvcheck import page_rows, slab_order
from cluster.core.tiers.slot_table import as_places
from cluster.fetch import copy_pairs
from cluster.tools.bench import common, harness
from cluster.tools.bench.pages_plan import (  # noqa: F401 (the plan's names, as before)
    FOOTPRINT_COPIES,
    FULL_SPEC,
    LARGE_REPS,
    LARGE_TOKENS,
    MEMORY_FRACTION,
    SMALL_REPS,
    Plan,
    _with_layers,
    fit_plan,
    footprint_bytes,
    memory_budget_bytes,
    reps_for,
    round_values,
)

MiB = common.MiB
PAGE_TOKENS = (16, 64, 256)
QUICK_PAGE_TOKENS = (16,)
REQUEST_TOKENS = (256, 1024, 4096, 16384, 32768)
QUICK_REQUEST_TOKENS = (256, 4096, 32768)
RATIO_PAGE_TOKENS = 16
CONTENDERS = ("memcpy_get", "get", "acquire_get", "warm_get", "noop", "memcpy_put", "put",
              "own_get", "own_get_after_copy")
ROUNDS = 5
# The host tier holds batch 0, one put, the lease for the next (a lease holds at most a
# quarter of the tier: cluster/core/put_leases.py) and a spare.
HOST_REQUESTS = 4
TOKEN_STRIDE = 1 << 16  # batch b's tokens start at b * TOKEN_STRIDE (> any request's tokens)
MAX_BATCHES = (1 << 32) // TOKEN_STRIDE  # token ids are uint32: a full run puts ~1,000 batches
OBJECT_STORE_BYTES = 256 * MiB
GOALS = {"small_page_overhead_us": {"max": 5.0}, "get_256_tokens_vs_noop_call": {"max": 1.5},
         "get_32k_tokens_vs_memcpy": {"min": 0.8}}
# name -> (how, raykv's figure, the baseline's, request tokens), at RATIO_PAGE_TOKENS;
# "overhead": (a - b) / pages in us, "ratio": a / b (seconds), "floor": (a + b) / a,
# "per_page": a / pages in us (b unused), "excess": (a - b - memcpy_get) / pages in us.
RATIOS = {
    "small_page_overhead_us": ("overhead", "get", "memcpy_get", 4096),
    "get_256_tokens_vs_noop_call": ("ratio", "get", "noop", 256),
    "get_32k_tokens_vs_memcpy": ("ratio", "memcpy_get", "get", 32768),
    "get_256_tokens_floor_vs_noop_call": ("floor", "noop", "memcpy_get", 256),
    "small_page_warm_overhead_us": ("overhead", "warm_get", "memcpy_get", 4096),
    "small_page_acquire_overhead_us": ("overhead", "acquire_get", "memcpy_get", 4096),
    "acquire_get_256_tokens_vs_noop_call": ("ratio", "acquire_get", "noop", 256),
    "acquire_get_32k_tokens_vs_memcpy": ("ratio", "memcpy_get", "acquire_get", 32768),
    "warm_get_32k_tokens_vs_memcpy": ("ratio", "memcpy_get", "warm_get", 32768),
    "small_page_put_overhead_us": ("overhead", "put", "memcpy_put", 4096),
    "put_32k_tokens_vs_memcpy": ("ratio", "memcpy_put", "put", 32768),
    "small_page_own_work_us": ("per_page", "own_get", "own_get", 4096),
    "small_page_own_work_after_copy_us": ("per_page", "own_get_after_copy",
                                          "own_get_after_copy", 4096),
    "small_page_copy_excess_us": ("excess", "get", "own_get_after_copy", 4096),
}


# ---- one page size: the service, its tensors, the contenders --------------------------------


@dataclass(slots=True)
class Session:
    """One page size's service and client, kv and out for the largest request (batch 0's
    tokens), a private buffer of pages for the put's memcpy, and the paths not taken."""

    plan: Plan
    page_tokens: int
    client: object
    reader: object  # a second client: the cold gets' (it put nothing)
    kv: torch.Tensor
    out: torch.Tensor
    targets: torch.Tensor  # [pages, *page_shape]
    num_batches: int = 1  # batch 0 is put at the start
    unmet: dict = dataclasses.field(default_factory=dict)  # (figure, tokens) -> why

    def tokens(self, batch: int, num_tokens: int) -> np.ndarray:
        return batch_tokens(batch, num_tokens)

    def get(self, num_tokens: int, client=None) -> None:
        got, _ = (client or self.client).get(self.tokens(0, num_tokens), out=self.out)
        if got != num_tokens:
            raise RuntimeError(f"get returned {got} of {num_tokens} tokens")

    def expect(self, figure: str, num_tokens: int, taken: bool, why: str) -> None:
        if not taken:
            self.unmet.setdefault((figure, num_tokens), why)


def service_config(plan: Plan, page_tokens: int, disk_dir: str) -> CacheConfig:
    """The host tier on top (no device tier) and no disk tier: nothing is demoted. The client
    leases free slots for up to two of the largest requests ahead of its puts."""
    request_bytes = plan.max_tokens * plan.spec.bytes_per_token
    return CacheConfig(page_tokens=page_tokens, device_bytes=0, disk_bytes=0,
                       host_bytes=HOST_REQUESTS * request_bytes, put_lease_bytes=2 * request_bytes,
                       eviction="lru", disk_codec="none", disk_dir=disk_dir)


def start_session(plan: Plan, page_tokens: int, disk_dir: str) -> Session:
    """The service, batch 0 put and read back byte for byte."""
    client = common.start_service(service_config(plan, page_tokens, disk_dir), plan.spec)
    if client.local is None:
        raise RuntimeError("the client does not map this node's slabs: no host tier path")
    num_pages = plan.max_tokens // page_tokens
    kv = common.page_kv(plan.spec, page_tokens, num_pages)
    targets = torch.empty((num_pages, *plan.spec.page_shape(page_tokens)), dtype=kv.dtype)
    targets.view(torch.uint8).fill_(0xA5)
    from cluster import connect

    session = Session(plan, page_tokens, client, connect(plan.spec), kv,
                      common.touched_like(kv), targets)
    if client.put(session.tokens(0, plan.max_tokens), kv) != plan.max_tokens:
        raise RuntimeError("batch 0 was not stored whole")
    session.get(plan.max_tokens)
    common.check_same(session.out, kv, "batch 0")
    return session


def _noop_steps(node):
    """One no-op call to the node actor, awaited as the client's calls are."""
    return (yield Wait([node.ping()]))


def memcpy_get_s(session: Session, num_tokens: int, reps: int) -> float:
    """copy_pages from the request's host-tier slots (held under a lease, untimed) into out,
    as the get copies them: one block per run of consecutive slots (fetch.copy_pairs)."""
    client = session.client
    keys = client.keys(session.tokens(0, num_tokens))
    stamp, lease_id, slots, _ = ray.get(client.local.acquire(client.geometry, keys))
    try:
        common.map_slabs(client, stamp)
        pairs, mapped = copy_pairs(client.view.slabs, as_places(slots), session.out, 0)
        session.expect("memcpy_get", num_tokens, mapped == len(keys),
                       "batch 0's pages are not all in this node's host tier")
        seconds = common.warm_median_s(lambda: copy_pages(pairs), reps)
    finally:
        ray.get(client.local.release(lease_id))
    window = slice(0, num_tokens)
    common.check_same(session.out[:, :, :, window], session.kv[:, :, :, window], "memcpy_get")
    return seconds


GET_PATHS = {  # contender -> (whose get, reads the held index, (local, optimistic, held) pages)
    "get": ("reader", True, (1, 1, 1)),
    "acquire_get": ("reader", False, (1, 0, 0)),
    "warm_get": ("client", True, (1, 1, 0)),
    "own_get": ("reader", True, (1, 1, 1)),
    "own_get_after_copy": ("reader", True, (1, 1, 1)),
}
_HELD_UNTAKEN = "a cold get did not find every page in the node's held-pages index"
GET_UNTAKEN = {"get": _HELD_UNTAKEN, "own_get": _HELD_UNTAKEN, "own_get_after_copy": _HELD_UNTAKEN,
               "acquire_get": "a cold get did not take every page through the node's acquire",
               "warm_get": "a warm get asked the node: its notes went stale"}


@contextlib.contextmanager
def copies_skipped():
    """The get's copy of this node's pages made a no-op, for the own_get phase timings: the
    blocks are still made and the step's hand-off kept; the copy and its rate sample (which
    would tell the node of a copy that never ran) are not."""
    real = fetch._copy_places

    def no_copy(view, places, out, first_page):
        _, mapped = fetch.copy_pairs(view.slabs, places, out, first_page)
        yield Work(lambda: None)
        return mapped

    fetch._copy_places = no_copy
    try:
        yield
    finally:
        fetch._copy_places = real


def get_s(session: Session, num_tokens: int, reps: int, path: str,
          before: Callable[[], object] | None = None) -> float:
    """Gets of the request's tokens, each after the getting client dropped its notes of the
    pages (GET_PATHS): `get` and `acquire_get` by the reader, which put nothing, through the
    node's held-pages index or its acquire; `warm_get` by the client that put them, right after
    such a get (untimed), from the slots it noted (a note is trusted for slabs.HINT_TTL_S);
    `own_get*`: `get` with its copy skipped (copies_skipped), each after `before()`, untimed."""
    whose, use_held, expected = GET_PATHS[path]
    client = getattr(session, whose)
    counters, slabs = client.counters, client.view.slabs
    keys = client.keys(session.tokens(0, num_tokens))
    num_pages, taken = len(keys), []
    names = ("local_pages", "optimistic_pages", "held_pages")

    def once() -> float:
        slabs.forget(keys)
        if path == "warm_get":
            session.get(num_tokens, client)
        if before is not None:
            before()
        counted = [counters[name] for name in names]
        seconds, _ = common.timed(lambda: session.get(num_tokens, client))
        read = tuple(counters[name] - b for name, b in zip(names, counted, strict=True))
        taken.append(read == tuple(num_pages * e for e in expected))
        return seconds

    own = path.startswith("own_get")
    slabs.use_held = use_held
    try:
        with copies_skipped() if own else contextlib.nullcontext():
            once()
            seconds = statistics.median(once() for _ in range(reps))
    finally:
        slabs.use_held = True
    session.expect(path, num_tokens, all(taken[1:]), GET_UNTAKEN[path])
    if not own:  # own gets copy nothing: out holds the last get's copy
        common.check_same(session.out[:, :, :, :num_tokens], session.kv[:, :, :, :num_tokens],
                          path)
    return seconds


def batch_tokens(batch: int, num_tokens: int) -> np.ndarray:
    """Batch `batch`'s token ids: distinct from every other batch's, and valid token ids."""
    if not 0 <= batch < MAX_BATCHES or not 0 < num_tokens <= TOKEN_STRIDE:
        raise ValueError(f"batch {batch} of {num_tokens} tokens is outside the token id space")
    return np.arange(num_tokens, dtype=np.int64) + batch * TOKEN_STRIDE


def put_s(session: Session, num_tokens: int, reps: int) -> float:
    """Puts of fresh tokens; each one's pages discarded afterwards (untimed)."""
    client = session.client
    kv = session.kv[:, :, :, :num_tokens]

    def once() -> float:
        tokens = session.tokens(session.num_batches, num_tokens)
        session.num_batches += 1
        seconds, stored = common.timed(lambda: client.put(tokens, kv))
        session.expect("put", num_tokens, stored == num_tokens, "a put was not stored whole")
        session.expect("put", num_tokens, client.puts.settle(client.timeout_s),
                       "a put's background commit was not answered")  # then it can go:
        ray.get(client.local.discard(client.geometry, client.keys(tokens)))
        return seconds

    return statistics.median(once() for _ in range(reps))


def contenders(session: Session, num_tokens: int) -> dict[str, Callable[[int], float]]:
    """Every contender for one request size: seconds per call (median of its reps)."""
    reps, client = reps_for(num_tokens), session.client
    num_pages = num_tokens // session.page_tokens
    put_pairs = [(slab_order(session.targets[:num_pages]),  # one block, as a put's run
                  page_rows(session.kv[:, :, :, :num_tokens], session.page_tokens))]
    noop = lambda: run_sync(_noop_steps(client.local), client.timeout_s)  # noqa: E731
    return {"memcpy_get": lambda _: memcpy_get_s(session, num_tokens, reps),
            "get": lambda _: get_s(session, num_tokens, reps, "get"),
            "acquire_get": lambda _: get_s(session, num_tokens, reps, "acquire_get"),
            "warm_get": lambda _: get_s(session, num_tokens, reps, "warm_get"),
            "noop": lambda _: common.warm_median_s(noop, reps),
            "memcpy_put": lambda _: common.warm_median_s(lambda: copy_pages(put_pairs), reps),
            "put": lambda _: put_s(session, num_tokens, reps),
            "own_get": lambda _: get_s(session, num_tokens, reps, "own_get"),
            "own_get_after_copy": lambda _: get_s(session, num_tokens, reps, "own_get_after_copy",
                                                  before=lambda: copy_pages(put_pairs))}


def measure_page_size(plan: Plan, page_tokens: int, disk_dir: str,
                      step: Callable[[str], None]) -> dict:
    """Every request size's per-round seconds, medians and paths not taken."""
    session = start_session(plan, page_tokens, disk_dir)
    per_request: dict[str, dict] = {}
    for num_tokens in plan.request_tokens:
        step(f"{page_tokens}-token pages, {num_tokens} tokens")
        rounds = harness.interleave(contenders(session, num_tokens), plan.rounds)
        per_request[str(num_tokens)] = {
            "pages": num_tokens // page_tokens, "seconds": common.medians(rounds),
            "rounds": rounds, "us_per_page": {name: s / (num_tokens // page_tokens) * 1e6
                                              for name, s in common.medians(rounds).items()}}
    unmet = {f"{figure}@{tokens}": why for (figure, tokens), why in session.unmet.items()}
    del session
    common.stop_service()
    return {"page_bytes": plan.spec.page_bytes(page_tokens), "per_request": per_request,
            "not_taken": unmet}


# ---- report --------------------------------------------------------------------------------


def set_ratios(report: harness.Report, per_page: dict) -> None:
    """RATIOS at RATIO_PAGE_TOKENS; null where a request size was not run or a figure's path
    was not taken."""
    main = per_page.get(str(RATIO_PAGE_TOKENS))
    for name, (how, numerator, denominator, tokens) in RATIOS.items():
        figures = main["per_request"].get(str(tokens)) if main else None
        if figures is None:
            report.not_exercised(name, f"{tokens}-token requests were not run (memory)")
            continue
        why = [main["not_taken"].get(f"{f}@{tokens}") for f in (numerator, denominator)]
        if any(why):
            report.not_exercised(name, next(w for w in why if w))
            continue
        values = round_values(how, figures["rounds"][numerator], figures["rounds"][denominator],
                              figures["pages"], figures["rounds"]["memcpy_get"])
        report.ratio(name, statistics.median(values), values)


def notes(plan: Plan) -> list[str]:
    full_kib, kib = FULL_SPEC.bytes_per_token // 1024, plan.spec.bytes_per_token // 1024
    return [
        f"geometry: Llama-3.1-8B's KV is 2 x 32 layers x 8 kv heads x 128 x 2 B = {full_kib} KiB "
        f"per token; this run used {plan.spec.num_layers} layers ({kib} KiB per token, "
        f"1/{plan.layer_scale} of it) so that {FOOTPRINT_COPIES} copies of the largest request "
        f"({plan.max_tokens} tokens) fit in {MEMORY_FRACTION:.0%} of MemAvailable "
        f"({plan.budget_bytes / 2**30:.1f} GiB); a {RATIO_PAGE_TOKENS}-token page is "
        f"{plan.spec.page_bytes(RATIO_PAGE_TOKENS) // 1024} KiB here, "
        f"{FULL_SPEC.page_bytes(RATIO_PAGE_TOKENS) // MiB} MiB at 32 layers",
        "scaling: the copies scale with bytes per token and the per-page and per-call costs do "
        "not, so at 32 layers get_32k_tokens_vs_memcpy would be higher (the overhead a smaller "
        "share), small_page_overhead_us about the same, and get_256_tokens_vs_noop_call higher "
        "(its memcpy alone is get_256_tokens_floor_vs_noop_call - 1 no-op calls here, 1/"
        f"{plan.layer_scale} of what it would be)",
        f"ratios at {RATIO_PAGE_TOKENS}-token pages (per_page_tokens: every size's figures), "
        "each the median of per-round values (spread); every contender runs once a round in "
        "rotating order (harness.interleave); a figure is the median of reps calls",
        "get: a second client's first get of a prefix the first client put (its notes "
        "dropped before each): the node's held-pages index, copies, generation check, no call "
        "(the node and the directory hear of it later, in batches); acquire_get: the same "
        "with the index unread (the node's acquire, one call; copies, release: get's path "
        "before the index); warm_get: a get right after another "
        f"(copies from noted slots, no call); both copy with copies.copy_pages ({COPY_THREADS} "
        "threads for a batch >= 8 MiB), one block per run of consecutive slots, as the memcpy "
        "baselines do over the same bytes: memcpy_get from the same host-tier slots, in the "
        "same blocks (fetch.copy_pairs), into the same out",
        "noop: NodeHandle.ping awaited through cluster.calls (the node actor answers at once)",
        "put: copies into the host-tier slots the client's lease holds (no call; the "
        "background commit and lease top-up waited for after, untimed; the client leases up to "
        "two of the largest requests ahead, put_lease_bytes), or reserve call, copies, commit "
        "call where the lease falls short; pages discarded after, untimed; memcpy_put: kv's "
        "page slices into one private buffer of pages in one block "
        "(a put copies one block per run of consecutive reserved slots)",
        "get_256_tokens_floor_vs_noop_call: (noop + memcpy_get) / noop at 256 tokens, the "
        "least a get with one call can cost; the small_page_*_overhead_us and *_vs_memcpy "
        "ratios without a goal are shown alongside (warm gets, puts)",
        "the machine is shared: see machine.loadavg_*",
    ]


def _config(plan: Plan, quick: bool) -> dict:
    return {"page_tokens": list(plan.page_tokens), "request_tokens": list(plan.request_tokens),
            "rounds": plan.rounds, "reps": {"small": SMALL_REPS, "large": LARGE_REPS,
                                            "large_from_tokens": LARGE_TOKENS},
            "model": "Llama-3.1-8B", "num_layers": plan.spec.num_layers,
            "full_num_layers": FULL_SPEC.num_layers, "bytes_per_token": plan.spec.bytes_per_token,
            "full_bytes_per_token": FULL_SPEC.bytes_per_token, "budget_bytes": plan.budget_bytes,
            "copy_threads": COPY_THREADS, "top_tier": "host (device_bytes=0, disk_bytes=0)",
            "quick": quick}


def print_report(result: dict) -> None:
    rows = []
    for page_tokens, size in result["per_page_tokens"].items():
        for num_tokens, figures in size["per_request"].items():
            us = figures["us_per_page"]
            rows.append([f"{page_tokens} x {num_tokens}", *(f"{us[name]:.1f}" for name in
                                                             CONTENDERS)])
    common.print_tables([common.table("raykv pages: us per page (medians)",
                                      ["pages x tokens", *CONTENDERS], rows)])


def run(json_path: str | None, quick: bool) -> dict:
    plan = fit_plan(memory_budget_bytes(), QUICK_PAGE_TOKENS if quick else PAGE_TOKENS,
                    QUICK_REQUEST_TOKENS if quick else REQUEST_TOKENS,
                    harness.MIN_ROUNDS if quick else ROUNDS)
    report = harness.Report("pages", "us per page, ratios", _config(plan, quick), GOALS,
                            notes(plan) + (["quick run: fewer sizes"] if quick else []))
    disk_root = tempfile.mkdtemp(prefix="raykv-bench-pages-", dir="/tmp")
    started_ray = common.ensure_local_ray(OBJECT_STORE_BYTES)
    per_page: dict[str, dict] = {}
    try:
        per_page = measure_all(plan, disk_root)
    finally:
        common.stop_service()
        shutil.rmtree(disk_root, ignore_errors=True)
        if started_ray:
            ray.shutdown()
    report["per_page_tokens"] = per_page
    report["ratio_basis"] = f"{RATIO_PAGE_TOKENS}-token pages"
    set_ratios(report, per_page)
    print_report(report.result)
    return report.finish(json_path)


def measure_all(plan: Plan, disk_root: str) -> dict[str, dict]:
    from rich.progress import Progress

    per_page: dict[str, dict] = {}
    with Progress() as progress:
        steps = common.Steps(progress, "pages", len(plan.page_tokens) * len(plan.request_tokens))
        for page_tokens in plan.page_tokens:
            disk_dir = os.path.join(disk_root, f"service-{page_tokens}")
            per_page[str(page_tokens)] = measure_page_size(plan, page_tokens, disk_dir, steps)
            per_page[str(page_tokens)]["phase_s"] = steps.laps()
    return per_page
