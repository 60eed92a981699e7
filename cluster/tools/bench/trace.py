"""`raykv bench trace --trace PATH`: the simulator checked against the live service, on a
public trace (issue 18's live check).

The first requests of a block trace (Mooncake's format), scaled so that the CPU model runs
(cluster/core/trace_scale.py: each 512-token block becomes one page of PAGE_TOKENS tokens of
text, keeping the prefix structure exact; the clock runs `speedup` times faster), are sent
over HTTP, open loop at their compressed times, to the Serve app on 3 simulated nodes (one
small-llama replica each, random weights), three ways:

    raykv         raykv's shared cache (a host tier per node), raykv's KV-aware router
    local-pow2    each replica only its own prefix cache of the same pages; Serve's pow2
    local-prefix  each replica only its own prefix cache; PrefixCacheAffinityRouter

Each contender starts from empty caches and a fresh Serve instance; rounds run every contender
once in rotating order (harness.interleave). The live hit ratio is cached tokens
(usage.prompt_tokens_details.cached_tokens) over prompt tokens of every request sent (a
failed request counts its prompt and no hit). Then `raykv sim`'s simulator runs the same
scaled configuration for each contender and round (trace_sim.py): the same nodes, capacities
in pages, router, eviction, requests at the times they were sent, and an engine speed fitted
to that live run. Ratios:

    sim_vs_live_hit_error     median over rounds of |live - simulated| hit ratio, raykv
    trace_hit_vs_local        raykv's live hit ratio / the best local contender's that round
    trace_ttft_p50_vs_local   raykv's live TTFT p50 / the best local p50 that round
    trace_ttft_p99_vs_local   the same at p99
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cluster.core.config import MiB
from cluster.core.spec import ModelSpec
from cluster.core.trace_format import read_trace
from cluster.core.trace_scale import (
    Scale,
    ScaledRequest,
    check_distinct,
    hit_errors,
    hit_ratio,
    scale_trace,
)
from cluster.serving import tokenizer
from cluster.serving.vllm_plan import load_outcome_of, served_tokens
from cluster.tools.bench import common, serve, trace_sim
from cluster.tools.bench.harness import Report, interleave
from cluster.tools.redis_server import free_port
from cluster.tools.simcluster import deploy, simulated_cluster, start_serve

MODEL = "small-llama"
NUM_NODES = trace_sim.NUM_NODES
CONTENDERS = {"raykv": ("raykv", False), "local-pow2": ("pow2", True),
              "local-prefix": ("prefix", True)}
LOCAL = ("local-pow2", "local-prefix")
MAX_SENDERS = 32  # client threads: more requests in flight than this are sent late
REQUEST_TIMEOUT_S = 120.0
GOALS = {"sim_vs_live_hit_error": {"max": 0.03}}
TRACE_NAME = "shared/traces/mooncake_conversation.jsonl"  # beside the repository's checkout


@dataclass(frozen=True, slots=True)
class Plan:
    """One run's sizes: the trace's first requests, the scale, the rounds, the pages each
    node's cache holds (raykv's host tier per node, each local replica's own cache)."""

    num_requests: int
    page_tokens: int
    speedup: float
    num_rounds: int
    pages_per_node: int

    @property
    def scale(self) -> Scale:
        return Scale(self.page_tokens, self.speedup, len(tokenizer.encode("")))

    @property
    def page_bytes(self) -> int:
        return ModelSpec.preset(MODEL).page_bytes(self.page_tokens)

    @property
    def cache_bytes(self) -> int:
        return self.pages_per_node * self.page_bytes


PLAN = Plan(num_requests=300, page_tokens=8, speedup=2.0, num_rounds=3, pages_per_node=2048)
QUICK_PLAN = Plan(num_requests=150, page_tokens=8, speedup=2.0, num_rounds=3,
                  pages_per_node=1024)


def default_trace() -> Path:
    """../shared/traces/mooncake_conversation.jsonl from the working directory, from this
    checkout, or (in a git worktree) from the main checkout: the first that exists."""
    repo = Path(__file__).resolve().parents[3]
    roots = [Path.cwd().parent, repo.parent]
    git = repo / ".git"
    if git.is_file():  # a worktree: "gitdir: <main>/.git/worktrees/<name>"
        gitdir = Path(git.read_text().split(":", 1)[1].strip())
        roots.append(gitdir.parents[2].parent)
    for root in roots:
        if (root / TRACE_NAME).is_file():
            return root / TRACE_NAME
    raise FileNotFoundError(f"no {TRACE_NAME} beside {[str(r) for r in roots]}; pass --trace")


def plan_for(quick: bool) -> Plan:
    return QUICK_PLAN if quick else PLAN


def cache_config(plan: Plan, disk_dir: str):
    """raykv's tiers: only host memory, so that the simulator's one tier per node is the
    same (no device tier to promote into, no disk to read back up from)."""
    from cluster import CacheConfig

    return CacheConfig(page_tokens=plan.page_tokens, device_bytes=0, host_bytes=plan.cache_bytes,
                       disk_bytes=0, disk_dir=disk_dir, disk_codec="none")


def app_args(name: str, plan: Plan) -> dict:
    router, own_cache = CONTENDERS[name]
    local = {"page_tokens": plan.page_tokens, "capacity_bytes": plan.cache_bytes}
    return {"model": MODEL, "router": router, "engine_num_cpus": 0, "max_ongoing_requests": 2,
            "max_queued_requests": -1, "max_context_tokens": 8192,
            "local_cache": local if own_cache else None}


def sim_setup(name: str, plan: Plan) -> trace_sim.SimSetup:
    """The simulator's configuration of a live contender: the same pages per node."""
    return trace_sim.sim_setup(name, plan.pages_per_node, plan.pages_per_node)


# ---- the live replay ------------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One request as the live service answered it."""

    index: int
    status: int = 0
    sent_at_s: float = 0.0  # after the replay's start
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    error: str = ""
    # vLLM's own per-request timings (`enable_per_request_metrics`: the reply's "metrics"),
    # None where the engine sends none: queued to first scheduled (a connector's load waits
    # in it), first scheduled to first token (the prefill's steps).
    engine_queue_ms: float | None = None
    engine_prefill_ms: float | None = None
    unfilled_tokens: int = 0  # counted cached by vLLM, not filled by raykv's loads


def replay(url: str, requests: list[ScaledRequest]) -> list[Sent]:
    """Send each request at its time (open loop), non-streamed with max_tokens 1: the answer
    is the first token, so its time is the TTFT."""
    import requests as http

    local = threading.local()

    def send(request: ScaledRequest, start_s: float) -> Sent:
        session = getattr(local, "session", None) or http.Session()
        local.session = session
        sent = Sent(request.index, sent_at_s=time.perf_counter() - start_s)
        body = {"model": MODEL, "prompt": request.text, "max_tokens": 1, "temperature": 0.0}
        began_s = time.perf_counter()
        try:
            reply = session.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
            sent.ttft_s = time.perf_counter() - began_s
            sent.status, sent.replica = reply.status_code, reply.headers.get("x-raykv-replica", "")
            if reply.status_code == 200:
                _read_answer(sent, reply.json())
            else:
                sent.error = reply.text[:200]
        except http.RequestException as error:
            sent.error = str(error)[:200]
        return sent

    with ThreadPoolExecutor(MAX_SENDERS) as pool:
        start_s = time.perf_counter()
        futures = []
        for request in requests:
            delay_s = start_s + request.send_at_s - time.perf_counter()
            if delay_s > 0:
                time.sleep(delay_s)
            futures.append(pool.submit(send, request, start_s))
        return [future.result() for future in futures]


def _read_answer(sent: Sent, answer: dict) -> None:
    """Fill `sent` from a completion's answer: its usage, and the engine's own timings. Its
    cached tokens are vLLM's count less what raykv's connector says its loads did not fill
    (vllm_plan.UNFILLED_KEY): vLLM counts a load cut short whole."""
    usage = answer["usage"]
    sent.prompt_tokens = usage["prompt_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    params = answer.get("kv_transfer_params")
    _, sent.unfilled_tokens = load_outcome_of(params)
    sent.cached_tokens = served_tokens(cached, params)
    metrics = answer.get("metrics") or {}
    sent.engine_queue_ms = metrics.get("queue_time_ms")
    sent.engine_prefill_ms = metrics.get("time_to_first_token_ms")


def warm_up(url: str, plan: Plan) -> None:
    """A few prompts shorter than a page on every replica: the first forwards' one-off costs
    are paid, and nothing is stored, so the caches start empty as the simulator's do."""
    short = ScaledRequest(0, 0.0, "w" * (plan.page_tokens - 2), 0, plan.page_tokens - 1, ())
    replay(url, [dataclasses.replace(short, index=i, text=f"{i % 10}" + short.text[1:])
                 for i in range(3 * NUM_NODES)])


def run_contender(name: str, plan: Plan, requests: list[ScaledRequest]) -> dict:
    """A fresh Serve instance (and for raykv a fresh service) replaying the requests."""
    from ray import serve as ray_serve

    from cluster import start, stop

    own_cache = CONTENDERS[name][1]
    disk_dir = tempfile.mkdtemp(prefix=f"raykv-bench-trace-{name}-", dir="/tmp")
    try:
        stop()
        if not own_cache:
            start(cache_config(plan, disk_dir))
        url = start_serve(free_port())
        deploy(app_args(name, plan))
        warm_up(url, plan)
        sent = replay(url, requests)
        cache = serve.cache_figures(own_cache)
        return {"summary": summarize(sent, requests), "sent": sent,
                "evicted_pages": serve.evicted_pages(cache), "cache": cache}
    finally:
        ray_serve.shutdown()
        stop()
        shutil.rmtree(disk_dir, ignore_errors=True)


def summarize(sent: list[Sent], requests: list[ScaledRequest]) -> dict:
    """Hit ratio over every request's prompt tokens (failures hit nothing), TTFT of the
    answered ones, lateness of the sends, replica shares."""
    ok = [s for s in sent if s.status == 200]
    ttft_s = [s.ttft_s for s in ok] or [0.0]
    late_s = [s.sent_at_s - r.send_at_s for s, r in zip(sent, requests, strict=True)]
    shares: dict[str, int] = {}
    for s in ok:
        shares[s.replica] = shares.get(s.replica, 0) + 1
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    cached_tokens = sum(s.cached_tokens for s in ok)
    return {"requests": len(sent), "ok": len(ok), "errors": len(sent) - len(ok),
            "hit_ratio": hit_ratio(cached_tokens, prompt_tokens),
            "cached_tokens": cached_tokens, "prompt_tokens": prompt_tokens,
            "prompt_tokens_mismatched": sum(s.prompt_tokens != r.prompt_tokens
                                            for s, r in zip(sent, requests, strict=True)
                                            if s.status == 200),
            **{f"ttft_{k}": v for k, v in common.latency_ms(ttft_s).items()},
            "send_late_p99_ms": common.percentile_ms(late_s, 99),
            "replica_shares": {k: v / max(1, len(ok)) for k, v in sorted(shares.items())}}


# ---- the simulated side ---------------------------------------------------------------------


def simulate_round(name: str, plan: Plan, requests: list[ScaledRequest], live: dict) -> dict:
    """The simulator on this contender's configuration, its requests at the times the live
    replay sent them, its engine fitted to that live run's service times."""
    ok = [s for s in live["sent"] if s.status == 200]
    service_s = trace_sim.service_times([s.sent_at_s for s in ok], [s.ttft_s for s in ok],
                                        [s.replica for s in ok])
    fit = trace_sim.fit_engine([s.prompt_tokens - s.cached_tokens for s in ok], service_s)
    sent = live["sent"]
    sims = trace_sim.sim_requests(requests, plan.scale, MODEL, [s.sent_at_s for s in sent])
    return trace_sim.simulate(sim_setup(name, plan), fit, plan.scale, plan.page_bytes, sims)


# ---- ratios ---------------------------------------------------------------------------------


def per_round(rounds: dict[str, list[dict]], name: str, field: str) -> list[float]:
    return [float(r["summary"][field]) for r in rounds[name]]


def best_local(rounds: dict[str, list[dict]], field: str, higher: bool) -> list[float]:
    """Each round's best local figure: the higher (hit ratio) or the lower (TTFT)."""
    pick = max if higher else min
    return [pick(float(rounds[n][i]["summary"][field]) for n in LOCAL)
            for i in range(len(rounds["raykv"]))]


def exercised(rounds: dict[str, list[dict]]) -> str:
    """Why the comparison was not exercised ("" when it was): every contender answered
    nearly every request and cached tokens in every round, and raykv's caches evicted pages
    (else their capacity was no limit, and the simulator's capacities were never tested)."""
    for name, runs in rounds.items():
        for index, run in enumerate(runs):
            summary = run["summary"]
            if summary["ok"] < 0.95 * summary["requests"]:
                return f"{name} answered {summary['ok']} of {summary['requests']} in round {index}"
            if not summary["cached_tokens"]:
                return f"{name} cached no token in round {index}"
    if not sum(r["evicted_pages"] for r in rounds["raykv"]):
        return "raykv's caches evicted nothing: capacity was no limit"
    return ""


def fill_ratios(report: Report, rounds: dict[str, list[dict]],
                simulated: dict[str, list[dict]]) -> None:
    why = exercised(rounds)
    if not report.require("sim_vs_live_hit_error", not why, why):
        return
    for name in rounds:
        errors = hit_errors(per_round(rounds, name, "hit_ratio"),
                            [s["hit_ratio"] for s in simulated[name]])
        ratio = "sim_vs_live_hit_error" + ("" if name == "raykv" else
                                           "_" + name.replace("-", "_"))
        report.ratio(ratio, statistics.median(errors), errors)
    report.paired("trace_hit_vs_local", per_round(rounds, "raykv", "hit_ratio"),
                  best_local(rounds, "hit_ratio", higher=True))
    for ratio, field in (("trace_ttft_p50_vs_local", "ttft_p50_ms"),
                         ("trace_ttft_p99_vs_local", "ttft_p99_ms")):
        report.paired(ratio, per_round(rounds, "raykv", field),
                      best_local(rounds, field, higher=False))


# ---- the run --------------------------------------------------------------------------------


def print_rounds(rounds: dict[str, list[dict]], simulated: dict[str, list[dict]]) -> None:
    rows = []
    for name, runs in rounds.items():
        for index, run in enumerate(runs):
            s, sim = run["summary"], simulated[name][index]
            rows.append([f"{name} r{index}", str(s["requests"]), str(s["errors"]),
                         f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}",
                         f"{s['hit_ratio']:.4f}", f"{sim['hit_ratio']:.4f}",
                         str(run["evicted_pages"]), str(sim["evicted_pages"]),
                         " ".join(f"{v:.2f}" for v in s["replica_shares"].values())])
    common.print_tables([common.table(
        "live against simulated, per contender and round",
        ["contender", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "hit live",
         "hit sim", "evicted live", "evicted sim", "replica shares"], rows)])


def notes(plan: Plan, trace_path: str, num_blocks: int, span_s: float) -> list[str]:
    return [
        f"trace: the first {plan.num_requests} requests of {Path(trace_path).name}, "
        f"{num_blocks} distinct full blocks; each 512-token block is one {plan.page_tokens}-"
        f"token page of text (block_tokens_live = page_tokens = {plan.page_tokens}; prefix "
        f"structure exact, cluster/core/trace_scale.py), the partial last block a shorter "
        f"tail; time compressed {plan.speedup:g}x (the {span_s * plan.speedup:.0f} s of the "
        f"trace sent in {span_s:.0f} s, open loop, {MAX_SENDERS} client threads), max_tokens "
        f"1, not streamed (the answer is the first token: its time is the TTFT)",
        f"caches: {plan.pages_per_node} pages per node ({plan.cache_bytes // MiB} MiB of "
        f"{MODEL}): raykv's host tier on each of {NUM_NODES} nodes (no device or disk tier), "
        f"or each local replica's own cache; every contender starts empty (the warm-up "
        f"prompts are shorter than a page: nothing is stored)",
        "hit ratio: cached tokens over the prompt tokens of every request sent, live "
        "(usage.prompt_tokens_details.cached_tokens) and simulated alike; no warm-up is "
        "excluded (both start cold)",
        "simulated: cluster/tools/bench/trace_sim.py, raykv sim's SimCluster, routers, "
        "eviction policies and control loop on the same nodes, capacities in pages, router "
        "and requests (at the times the live replay sent them), the engine's prefill fitted "
        "to the same live run (overhead + per token x uncached tokens, through the median "
        "service time, read off each replica's answers, of five groups of request sizes). "
        "Local "
        "contenders: the simulator's LRU orders a prompt's pages head first, the live "
        "PrefixLRU tail first (vLLM's order); their errors are reported, without a goal",
        "*_vs_local: raykv against the best local contender of each round (the higher hit "
        "ratio; the lower TTFT at each percentile), paired, the median taken",
    ]


def run(json_path: str | None, quick: bool, trace_path: str | None = None) -> dict:
    from rich.progress import Progress

    plan = plan_for(quick)
    trace_path = str(trace_path or default_trace())
    requests = scale_trace(read_trace(trace_path, plan.num_requests), plan.scale)
    num_blocks = check_distinct(requests, plan.scale)
    rounds: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    simulated: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    config = {"model": MODEL, "nodes": NUM_NODES, "trace": trace_path, "quick": quick,
              **dataclasses.asdict(plan), "page_bytes": plan.page_bytes,
              "sim_setups": {n: dataclasses.asdict(sim_setup(n, plan)) for n in CONTENDERS}}
    span_s = requests[-1].send_at_s if requests else 0.0
    report = Report("trace", "hit ratio; ms", config, GOALS,
                    notes(plan, trace_path, num_blocks, span_s))

    def contender(name: str):
        def one_round(round_index: int) -> float:
            live = run_contender(name, plan, requests)
            simulated[name].append(simulate_round(name, plan, requests, live))
            rounds[name].append(live)
            return live["summary"]["hit_ratio"]
        return one_round

    with simulated_cluster(NUM_NODES), Progress() as progress:
        steps = common.Steps(progress, "trace", plan.num_rounds)
        interleave({name: contender(name) for name in CONTENDERS}, plan.num_rounds,
                   on_round=lambda i, names: steps(f"round {i}: {' '.join(names)}"))
    report["phase_s"] = steps.laps()
    print_rounds(rounds, simulated)
    report["per_round"] = {n: [{**r["summary"], "evicted_pages": r["evicted_pages"],
                                "cache": r["cache"]} for r in runs]
                           for n, runs in rounds.items()}
    report["simulated_per_round"] = {n: [{k: v for k, v in s.items() if k != "directory"}
                                         for s in sims] for n, sims in simulated.items()}
    report["live_requests"] = {n: [columns(r["sent"]) for r in runs] for n, runs in rounds.items()}
    fill_ratios(report, rounds, simulated)
    return report.finish(json_path)


def columns(sent: list[Sent]) -> dict[str, list]:
    """Every request of a live run, column by column (for a later look at the JSON)."""
    return {"sent_at_s": [round(s.sent_at_s, 4) for s in sent],
            "ttft_ms": [round(s.ttft_s * 1e3, 2) for s in sent],
            "cached_tokens": [s.cached_tokens for s in sent],
            "prompt_tokens": [s.prompt_tokens for s in sent],
            "status": [s.status for s in sent], "replica": [s.replica for s in sent]}
