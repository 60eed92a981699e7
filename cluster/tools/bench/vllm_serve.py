"""`raykv bench vllm-serve`: raykv under Ray Serve LLM's vLLM engines against Ray's own
KV-aware router, on the same engines and the same trace (issue 19's benchmark).

Set-up: 3 simulated nodes, one vLLM replica each (CPU build, small-llama with random weights),
the four set-ups of vllm_serve_setups.py (raykv; kv-aware: Ray's KVAwareRouter over vLLM's own
prefix cache; prefix: PrefixCacheAffinityRouter; pow2). Every (round, set-up) gets a fresh app
(fresh engines, empty caches; for raykv a fresh service), in rotating order
(harness.interleave). The workload is Mooncake's conversation trace thinned by conversation
and scaled (vllm_serve_trace.py), sent open loop over HTTP with max_tokens 1 (trace.replay:
the client's time is the TTFT). Each round keeps other conversations.

Ray's KVAwareRouter is run as Ray documents it: direct streaming (LLMRouter tokenizes and
scores, HAProxy forwards) with RAY_SERVE_ENABLE_HA_PROXY=1 and
RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 (the body reaches the router; without it the
router load-balances) in the cluster's environment. `--setups raykv-direct` adds raykv's app
with direct streaming (raykv's router behind the same HAProxy, cluster/serving/vllm_direct.py);
it is not in the default run, and the ratios are raykv's keyed-ingress set-up's. HAProxy
and Serve's direct ingress bind every interface, so the benchmark runs in a network namespace of
its own (`unshare -n`, loopback only); every set-up goes through the same HAProxy front.

Ratios (Report.paired: the median of per-round ratios):
    ttft_p50_vs_kv_aware, ttft_p99_vs_kv_aware   raykv's client TTFT / kv-aware's
    cached_tokens_vs_kv_aware                    usage.prompt_tokens_details.cached_tokens summed
    cached_tokens_bound_vs_kv_aware              (no goal) the tokens one cache that never evicts
                                                 would serve over kv-aware's cached tokens: the
                                                 most any set-up could reach on the workload
    ttft_p50_vs_prefix_router                    raykv / PrefixCacheAffinityRouter
    max_replica_share                            raykv's busiest replica's share (Serve's request
                                                 counter by replica)
    recompute_decisions_correct                  the recompute part (vllm_serve_recompute.py):
                                                 with the disk as it is and slowed, the share
                                                 of routed requests where the router chose
                                                 the faster of fetching and recomputing, both
                                                 run several times
A ratio whose set-ups failed requests, cached nothing, or whose working set fit in the engines'
caches, is not exercised (null; the run exits 2).

Per request (vllm_serve_breakdown.py): every engine replies with vLLM's own timings, so the JSON
keeps each round's requests (`requests`: TTFT, engine queue, engine prefill, the rest outside the
engine, cached tokens), each set-up's split (`ttft_split`) and raykv's paired by request with
each baseline (`ttft_split_paired`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.core.trace_format import read_trace
from cluster.core.trace_scale import Scale, ScaledRequest, check_distinct
from cluster.serving.engine_rates import rates_files_since, read_published, remove_published
from cluster.tools.bench import common
from cluster.tools.bench.harness import Report, interleave
from cluster.tools.bench.vllm_serve_bound import fill_ttft_bounds
from cluster.tools.bench.vllm_serve_breakdown import columns, report_fields
from cluster.tools.bench.vllm_serve_plan import (  # noqa: F401 (the plan's names, as before)
    MODEL,
    PLAN,
    QUICK_PLAN,
    TIERS_PROFILE,
    Plan,
    node_tiers,
    plan_for,
)
from cluster.tools.bench.vllm_serve_report import notes, print_rounds
from cluster.tools.bench.vllm_serve_setups import EXTRA_SETUPS, SETUPS, uses_service
from cluster.tools.bench.vllm_serve_trace import (
    conversations,
    distinct_blocks,
    prefix_reuse,
    reusable_blocks,
    reusable_blocks_per_request,
    round_trace,
)
from cluster.tools.redis_server import free_port

PARTS = ("main", "recompute")  # the replayed trace's set-ups; the recompute part
NUM_NODES = 3
START_TIMEOUT_S = 600.0
METRICS_SETTLE_S = 5.0  # Serve's metrics reach Prometheus every 2 s here (simcluster)
GOALS = {"ttft_p50_vs_kv_aware": {"max": 0.8}, "ttft_p99_vs_kv_aware": {"max": 0.7},
         "cached_tokens_vs_kv_aware": {"min": 1.3}, "ttft_p50_vs_prefix_router": {"max": 0.8},
         "max_replica_share": {"max": 0.5}, "recompute_decisions_correct": {"min": 0.9}}
# Each part's ratios: a run of some parts reports (and sets goals for) only theirs.
PART_RATIOS = {"main": ("ttft_p50_vs_kv_aware", "ttft_p99_vs_kv_aware",
                        "cached_tokens_vs_kv_aware", "ttft_p50_vs_prefix_router",
                        "max_replica_share"),
               "recompute": ("recompute_decisions_correct",)}
# HAProxy, and the body forwarded to the direct-streaming router (Ray's LLMRouter and raykv's
# both route on the prompt; without it HAProxy sends them an empty body and they load-balance:
# Ray's LLMRouter logs "Could not derive a routing key from the request body").
CHILD_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
             "VLLM_HOST_IP": "127.0.0.1"}
REQUEST_COUNTER = "ray_serve_deployment_request_counter"


def setups_for(quick: bool, chosen: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The set-ups a run replays: `chosen` (in SETUPS' order; ValueError for an unknown one),
    else all but, in a quick run, pow2, which no ratio reads: every (round, set-up) starts
    three engines afresh, 2.5-4 minutes on 2 cores (a quick run of 3 x 3 took 40 minutes
    here; the full one, 12 apps and longer replays, about an hour)."""
    if chosen:
        known = SETUPS + EXTRA_SETUPS
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise ValueError(f"unknown set-ups {unknown}; known: {list(known)}")
        return tuple(s for s in known if s in chosen)
    return tuple(s for s in SETUPS if not (quick and s == "pow2"))


def round_traces(plan: Plan, trace_path: str) -> list[list[ScaledRequest]]:
    """Each round's scaled requests: conversations offset by the round's index."""
    from cluster.serving import tokenizer

    groups = conversations(read_trace(trace_path))
    scale = Scale(plan.engine.block_tokens, plan.thinning.speedup, len(tokenizer.encode("")))
    traces = [round_trace(groups, plan.thinning, index, scale) for index in range(plan.num_rounds)]
    for requests in traces:
        check_distinct(requests, scale)
    return traces


# ---- one (round, set-up) --------------------------------------------------------------------


def cache_config(plan: Plan, disk_dir: str):
    from cluster import CacheConfig

    return CacheConfig(page_tokens=plan.engine.block_tokens, device_bytes=0,
                       host_bytes=plan.host_bytes, disk_bytes=plan.disk_bytes,
                       disk_dir=disk_dir, disk_codec="none")


def build(setup: str, plan: Plan, model_dir: str):
    """The set-up's Serve application (for raykv, on the running service)."""
    from ray.serve.llm import build_openai_app

    from cluster.tools.bench import vllm_serve_setups as setups

    if setup == "raykv":
        return setups.raykv_app(model_dir, MODEL, plan.engine, NUM_NODES)
    if setup == "raykv-async":
        return setups.raykv_app(model_dir, MODEL, plan.engine, NUM_NODES, load_mode="async")
    if setup == "raykv-save-async":
        return setups.raykv_app(model_dir, MODEL, plan.engine, NUM_NODES, save_mode="async")
    if setup == "raykv-rerender":
        return setups.raykv_app(model_dir, MODEL, plan.engine, NUM_NODES, engine_render=False)
    if setup == "raykv-direct":
        return setups.raykv_direct_app(model_dir, MODEL, plan.engine, NUM_NODES)
    if setup == "kv-aware-raykv":
        return setups.kv_aware_raykv_app(model_dir, MODEL, plan.engine, NUM_NODES)
    config = setups.baseline_config(setup, model_dir, MODEL, plan.engine, NUM_NODES)
    if setup != "kv-aware":
        return build_openai_app({"llm_configs": [config]})
    return setups.direct_streaming_app(config)


def wait_ready(url: str, timeout_s: float = START_TIMEOUT_S, poll_s: float = 2.0) -> None:
    """Until the app at `url` answers /v1/models; TimeoutError past `timeout_s`."""
    import requests

    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            if requests.get(url + "/v1/models", timeout=5).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"the app served no /v1/models within {timeout_s} s")


def warm_up(url: str, plan: Plan) -> None:
    """Prompts shorter than a block, a few per replica: one-off costs paid, nothing cached."""
    from cluster.tools.bench.trace import replay

    short = plan.engine.block_tokens - 2
    replay(url, [ScaledRequest(i, 0.0, f"{i}" + "w" * (short - 1), 0, short + 1, ())
                 for i in range(3 * NUM_NODES)])


def replica_requests() -> dict[str, float]:
    """Requests each LLMServer replica has taken (Serve's counter, every node's metrics)."""
    from cluster.tools.simcluster import metric_lines

    totals: dict[str, float] = {}
    for line in metric_lines():
        if line.startswith(REQUEST_COUNTER) and "LLMServer" in line and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            totals[replica] = totals.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each replica's share of the requests counted between two scrapes (replicas of earlier
    apps, whose counters stay in the metrics, took none and are left out)."""
    taken = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    total = sum(taken.values())
    return {k: v / total for k, v in sorted(taken.items())} if total > 0 else {}


def run_setup(setup: str, plan: Plan, model_dir: str, requests: list[ScaledRequest],
              url: str) -> dict:
    """A fresh app of `setup` behind Serve's front at `url` replaying the round's requests."""
    from ray import serve

    from cluster import start, stop
    from cluster.tools.bench.trace import replay, summarize

    disk_dir = tempfile.mkdtemp(prefix=f"raykv-bench-vllm-serve-{setup}-", dir="/tmp")
    began_s, began_wall_s = time.monotonic(), time.time()
    rates_files: list[str] = []
    try:
        if uses_service(setup):
            start(cache_config(plan, disk_dir))
        serve.run(build(setup, plan, model_dir), name=setup, route_prefix="/",
                  blocking=False)
        wait_ready(url)
        started_s = time.monotonic() - began_s
        warm_up(url, plan)
        time.sleep(METRICS_SETTLE_S)
        before = replica_requests()
        sent = replay(url, requests)
        time.sleep(METRICS_SETTLE_S)
        summary = summarize(sent, requests)
        summary["replica_shares"] = shares(before, replica_requests())
        # this set-up's RaykvConnector engines (lookups, loads, prefill rate), before Serve
        # takes them down
        rates_files = rates_files_since(began_wall_s) if uses_service(setup) else []
        summary["engine_rates"] = [read_published(path) for path in rates_files]
        errors = sorted({s.error[:120] for s in sent if s.status != 200})[:3]
        return {"summary": summary, "ttft_ms": sorted(s.ttft_s * 1e3 for s in sent
                                                      if s.status == 200),
                "start_s": started_s, "error_samples": errors, "requests": columns(sent)}
    finally:
        serve.delete(setup)
        if uses_service(setup):
            stop()
        for path in rates_files:  # kv-aware-raykv's server class leaves its files behind
            remove_published(path)
        shutil.rmtree(disk_dir, ignore_errors=True)


# ---- ratios ---------------------------------------------------------------------------------


def figures(rounds: dict[str, list[dict]], setup: str, field: str) -> list[float]:
    return [float(r["summary"][field]) for r in rounds[setup]]


def exercised(rounds: dict[str, list[dict]], names: tuple[str, ...], plan: Plan,
              working_set_blocks: list[int]) -> str:
    """Why a comparison of these set-ups was not exercised ("" when it was): every request
    answered, some tokens cached, in every round; and the round's working set beyond what the
    engines' own caches hold together (else memory was no limit)."""
    for name in names:
        if name not in rounds:
            return f"{name} was not among this run's set-ups"
        for index, result in enumerate(rounds[name]):
            summary = result["summary"]
            if summary["errors"]:
                return (f"{name} failed {summary['errors']} of {summary['requests']} requests "
                        f"in round {index}: {result['error_samples']}")
            if not summary["cached_tokens"]:
                return f"{name} cached no token in round {index}"
    capacity = NUM_NODES * plan.engine.num_blocks
    if min(working_set_blocks) <= capacity:
        return (f"a round's working set ({min(working_set_blocks)} blocks) fits the engines' "
                f"own caches ({capacity} blocks): memory was no limit")
    return ""


def goals_for(parts: tuple[str, ...]) -> dict:
    """The goals of the ratios the parts run report."""
    return {name: goal for name, goal in GOALS.items()
            if any(name in PART_RATIOS[part] for part in parts)}


def fill_ratios(report: Report, rounds: dict[str, list[dict]], plan: Plan,
                working_set_blocks: list[int], recompute: dict | None = None,
                parts: tuple[str, ...] = PARTS,
                reusable_tokens: list[int] | None = None) -> None:
    """`reusable_tokens`: per round, the tokens a cache that never evicts would serve
    (vllm_serve_trace.reusable_blocks): the bound beside cached_tokens_vs_kv_aware."""
    if "main" in parts:
        fill_main(report, rounds, plan, working_set_blocks)
        if reusable_tokens is not None:
            fill_bound(report, rounds, plan, working_set_blocks, reusable_tokens)
    if "recompute" in parts:
        fill_recompute(report, recompute)


def fill_main(report: Report, rounds: dict[str, list[dict]], plan: Plan,
              working_set_blocks: list[int]) -> None:
    why = exercised(rounds, ("raykv", "kv-aware"), plan, working_set_blocks)
    for ratio, field in (("ttft_p50_vs_kv_aware", "ttft_p50_ms"),
                         ("ttft_p99_vs_kv_aware", "ttft_p99_ms"),
                         ("cached_tokens_vs_kv_aware", "cached_tokens")):
        if report.require(ratio, not why, why):
            report.paired(ratio, figures(rounds, "raykv", field),
                          figures(rounds, "kv-aware", field))
    why_prefix = exercised(rounds, ("raykv", "prefix"), plan, working_set_blocks)
    if report.require("ttft_p50_vs_prefix_router", not why_prefix, why_prefix):
        report.paired("ttft_p50_vs_prefix_router", figures(rounds, "raykv", "ttft_p50_ms"),
                      figures(rounds, "prefix", "ttft_p50_ms"))
    busiest = [max(r["summary"]["replica_shares"].values(), default=None)
               for r in rounds.get("raykv", [])] or [None]
    if report.require("max_replica_share", None not in busiest,
                      "Serve's request counter named no raykv replica in some round"):
        report.ratio("max_replica_share", statistics.median(busiest), busiest)


def fill_bound(report: Report, rounds: dict[str, list[dict]], plan: Plan,
               working_set_blocks: list[int], reusable_tokens: list[int]) -> None:
    """cached_tokens_bound_vs_kv_aware (no goal): the most any cache could serve in a round
    over what kv-aware's served, paired per round. Below cached_tokens_vs_kv_aware's goal, no
    set-up can meet that goal on this workload."""
    why = exercised(rounds, ("kv-aware",), plan, working_set_blocks)
    if report.require("cached_tokens_bound_vs_kv_aware", not why, why):
        report.paired("cached_tokens_bound_vs_kv_aware", [float(n) for n in reusable_tokens],
                      figures(rounds, "kv-aware", "cached_tokens"))


def fill_recompute(report: Report, recompute: dict | None) -> None:
    """recompute_decisions_correct: the share of all counted decisions, with the conditions'
    shares as its spread."""
    if recompute is None:
        report.not_exercised("recompute_decisions_correct", "the recompute part did not run")
    elif "error" in recompute:
        report.not_exercised("recompute_decisions_correct",
                             f"the recompute part failed: {recompute['error']}")
    elif report.require("recompute_decisions_correct", recompute["share"] is not None,
                        f"no probe counted: {recompute['summary']['all']['not_counted']}"):
        per_condition = [recompute["summary"][c]["correct_share"] for c in sorted(
            recompute["summary"]) if c != "all"]
        report.ratio("recompute_decisions_correct", recompute["share"], per_condition)


RECOMPUTE_NOTE = (
    "the recompute part alone (vllm_serve_recompute.py): raykv's app with one vLLM replica "
    f"({MODEL} float32 eager on vLLM's CPU build, its own prefix cache off) in the "
    f"{NUM_NODES}-node simulated cluster; per condition (the disk as it is, slowed by 20 ms "
    "a page I/O) 10 prefixes of 40 pages, each probed 3 times by a routed request, a forced "
    "fetch and a forced recompute in rotating order; a decision is right when it matches "
    "the faster of the forced runs' median TTFTs.")


@dataclass(frozen=True, slots=True)
class _Run:
    """What run_here's parts share: its inputs, and each set-up's results by round."""

    plan: Plan
    traces: list[list[ScaledRequest]]
    model_dir: str
    setups: tuple[str, ...]
    parts: tuple[str, ...]
    rounds: dict[str, list[dict]]


def run_here(json_path: str | None, quick: bool, trace_path: str | None = None,
             setups: tuple[str, ...] | None = None, parts: tuple[str, ...] = PARTS) -> dict:
    """The benchmark in this process (which must have CHILD_ENV set before Ray was imported)."""
    from cluster.serving.model_dir import save_model_dir
    from cluster.tools.bench.trace import default_trace

    plan = plan_for(quick)
    traces = round_traces(plan, trace_path or str(default_trace()))
    model_dir = save_model_dir(os.path.join(tempfile.mkdtemp(prefix="raykv-vs-"), MODEL))
    setups = setups_for(quick, setups) if "main" in parts else ()
    run = _Run(plan, traces, model_dir, setups, parts, {name: [] for name in setups})
    config = _config(run, quick)
    report = Report("vllm-serve", "ms", config, goals_for(parts),
                    notes(plan, traces) if "main" in parts else [RECOMPUTE_NOTE])
    order, recompute, phase_s = _replay_in_cluster(run)
    report["phase_s"] = phase_s
    _record_rounds(report, run.rounds, order, recompute)
    fill_ratios(report, run.rounds, plan, config["working_set_blocks"], recompute, parts,
                config["reusable_tokens_bound"])
    if "main" in parts:
        fill_ttft_bounds(report, report["requests"],
                         [[blocks * plan.engine.block_tokens
                           for blocks in reusable_blocks_per_request(t)] for t in traces])
    return report.finish(json_path)


def _config(run: _Run, quick: bool) -> dict:
    """The run's sizes and the trace's bounds, for the report."""
    plan, traces = run.plan, run.traces
    return {"model": MODEL, "nodes": NUM_NODES, "plan": asdict(plan), "quick": quick,
            "setups": list(run.setups), "parts": list(run.parts),
            "working_set_blocks": [distinct_blocks(t) for t in traces],
            "prefix_reuse_bound": [prefix_reuse(t) for t in traces],
            "reusable_tokens_bound": [reusable_blocks(t)[0] * plan.engine.block_tokens
                                      for t in traces]}


def _replay_in_cluster(run: _Run) -> tuple[list, dict | None, dict]:
    """Every round of every set-up (in run.rounds), then the recompute part, on one simulated
    cluster; returns the rounds' order, the recompute part's result and the phases' times."""
    from ray import serve
    from rich.progress import Progress

    from cluster.tools.bench.vllm_serve_setups import ENGINE_SLOT
    from cluster.tools.simcluster import simulated_cluster, start_serve

    with simulated_cluster(NUM_NODES, cpus_per_node=2, resources={ENGINE_SLOT: 1}), \
            Progress() as progress:
        url = start_serve(free_port())  # Serve's front
        steps = common.Steps(progress, "vllm-serve", run.plan.num_rounds)
        order = interleave({name: _setup_round(run, name, url) for name in run.setups},
                           run.plan.num_rounds,
                           on_round=lambda i, names: steps(f"round {i}: {' '.join(names)}")) \
            if run.setups else []
        recompute = _recompute_part(run, url, steps) if "recompute" in run.parts else None
        serve.shutdown()
    return order, recompute, steps.laps()


def _setup_round(run: _Run, name: str, url: str):
    """interleave's callable for set-up `name`: one round of it, its TTFT p50 (ms) back."""
    def one_round(round_index: int) -> float:
        run.rounds[name].append(run_setup(name, run.plan, run.model_dir,
                                          run.traces[round_index], url))
        return run.rounds[name][-1]["summary"]["ttft_p50_ms"]
    return one_round


def _recompute_part(run: _Run, url: str, steps: common.Steps) -> dict:
    from cluster.tools.bench.vllm_serve_recompute import run_part

    steps("recompute part")
    try:
        return run_part(run.plan.engine, run.model_dir, MODEL, NUM_NODES, url,
                        wait_ready, lambda at: warm_up(at, run.plan))
    except Exception as error:  # the main part's figures are kept; the ratio is not
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def _record_rounds(report: Report, rounds: dict[str, list[dict]], order: list,
                   recompute: dict | None) -> None:
    """Print the rounds; keep them, and the recompute part's result, in the report."""
    print_rounds(rounds)
    report["ttft_p50_ms_per_round"] = order
    report["per_round"] = {n: [{**r["summary"], "start_s": r["start_s"],
                                "error_samples": r["error_samples"]} for r in per_round]
                           for n, per_round in rounds.items()}
    report["ttft_ms"] = {n: [r["ttft_ms"] for r in per_round] for n, per_round in rounds.items()}
    report["requests"] = {n: [r["requests"] for r in per_round] for n, per_round in rounds.items()}
    for key, value in report_fields(report["requests"]).items():
        report[key] = value
    report["recompute"] = recompute


def run(json_path: str | None, quick: bool, setups: tuple[str, ...] | None = None,
        parts: tuple[str, ...] = PARTS) -> dict:
    """`raykv bench vllm-serve`: the benchmark in a child process in its own network namespace
    (loopback only: HAProxy and Serve's direct ingress bind every interface), with HAProxy on."""
    out = json_path or os.path.join(tempfile.mkdtemp(prefix="raykv-vs-"), "vllm-serve.json")
    if shutil.which("unshare") is None:
        raise RuntimeError("`unshare` (util-linux) is needed to run HAProxy on loopback only")
    child = [sys.executable, "-m", "cluster.tools.bench.vllm_serve", "--json", out]
    if quick:
        child.append("--quick")
    if setups:
        child += ["--setups", ",".join(setups_for(quick, setups))]
    if tuple(parts) != PARTS:
        child += ["--parts", ",".join(parts)]
    script = "ip link set lo up && exec " + " ".join(child)
    # The repository (Ray's workers import raykv) and vllm_compat (Ray 2.60's LLMRouter imports
    # a vLLM module that vLLM 0.32 moved: vllm_compat/sitecustomize.py) for every worker.
    paths = [str(Path(__file__).parents[3]), str(Path(__file__).parent / "vllm_compat"),
             os.environ.get("PYTHONPATH")]
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    isolate = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    done = subprocess.run([*isolate, "sh", "-c", script], env=env, check=False)
    if not os.path.exists(out):
        raise RuntimeError(f"the benchmark's process exited {done.returncode} without a result")
    with open(out) as file:
        return json.load(file)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="raykv bench vllm-serve, in this process")
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace")
    parser.add_argument("--setups", help="comma-separated, of " + ",".join(SETUPS))
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated, of " + ",".join(PARTS))
    arguments = parser.parse_args()
    run_here(arguments.json, arguments.quick, arguments.trace,
             tuple(arguments.setups.split(",")) if arguments.setups else None,
             tuple(arguments.parts.split(",")))
