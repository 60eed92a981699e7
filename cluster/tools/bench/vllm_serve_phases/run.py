"""Where a request's time goes in `raykv bench vllm-serve` (issue 19): chosen set-ups, one
round of the quick plan (optionally its first N requests), with per-request timings of the
engines' schedulers, RaykvConnector and raykv's router (site/sitecustomize.py, loaded by every
process of the run), vLLM's own metrics, and CPU seconds per process and per thread.

    PYTHONPATH=$PWD .venv-vllm/bin/python -m cluster.tools.bench.vllm_serve_phases.run \
        --out /tmp/phases --setups raykv,prefix
    .venv-vllm/bin/python -m cluster.tools.bench.vllm_serve_phases.analyze /tmp/phases

A diagnostic, not a benchmark: no ratios. Run it under the machine's heavy-work lock.
`--saves delay` (or `nice`) changes when raykv's connector puts its saves, to measure what
they cost the requests whose replies travel meanwhile (docs/benchmarks.md, vllm-serve:
raykv's time outside the engine, taken apart).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
SITE = Path(__file__).resolve().parent / "site"
SAVE_MODES = ("now", "delay", "nice")  # site/sitecustomize.py's RAYKV_PHASES_SAVES


def cpu_snapshot():
    import psutil
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline", "name", "cpu_times"]):
        try:
            cmd = proc.info["cmdline"] or [proc.info["name"]]
            times = proc.info["cpu_times"]
            out[proc.info["pid"]] = (" ".join(cmd)[:90], times.user + times.system)
        except Exception:
            pass
    return out


def cpu_delta(before, after):
    groups = {}
    for pid, (name, secs) in after.items():
        prev = before.get(pid, (name, 0.0))[1]
        key = name.split(" ")[0] if not name.startswith("ray::") else name.split(" ")[0]
        if "VLLM" in name or "EngineCore" in name:
            key = "VLLM::EngineCore"
        groups.setdefault(key, [0.0, 0])
        groups[key][0] += secs - prev
        groups[key][1] += 1
    return {k: (round(v[0], 2), v[1]) for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])
            if v[0] > 0.05}


def thread_snapshot():
    """CPU seconds per (process, thread name) of Ray's and vLLM's processes."""
    import psutil
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if not ("VLLM" in cmd or "ray::" in cmd or "gcs_server" in cmd or "raylet" in cmd):
                continue
            key = cmd.split(" ")[0].rsplit("/", 1)[-1][:60]
            for thread in proc.threads():
                try:
                    with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    name = "?"
                out[(proc.pid, thread.id)] = (key, name, thread.user_time + thread.system_time)
        except Exception:
            pass
    return out


def thread_delta(before, after):
    groups = {}
    for tid, (key, name, secs) in after.items():
        prev = before.get(tid, (key, name, 0.0))[2]
        groups[(key, name)] = groups.get((key, name), 0.0) + secs - prev
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:40]
    return [[k[0], k[1], round(v, 2)] for k, v in top if v > 0.1]


def vllm_metric_lines():
    from cluster.tools.simcluster import metric_lines
    return [line for line in metric_lines() if "vllm" in line and not line.startswith("#")]


@dataclass
class _Round:
    """The round every set-up replays, and what each replay recorded, by set-up."""

    plan: object  # vllm_serve.Plan
    model_dir: str
    requests: list
    results: dict = field(default_factory=dict)
    setup: str | None = None  # the set-up being run


def child(args):
    import tempfile

    import psutil  # noqa: F401

    from cluster.serving.model_dir import save_model_dir
    from cluster.tools.bench import trace as trace_mod
    from cluster.tools.bench import vllm_serve as vs
    from cluster.tools.bench.trace import default_trace

    plan = vs.plan_for(not args.full)
    traces = vs.round_traces(plan, str(default_trace()))
    requests = traces[args.round][: args.max_requests or None]
    model_dir = save_model_dir(os.path.join(tempfile.mkdtemp(prefix="raykv-vs-"), vs.MODEL))
    run = _Round(plan, model_dir, requests)
    original_replay = trace_mod.replay

    def recording_replay(url, reqs):
        if len(reqs) != len(requests):  # the warm-up
            return original_replay(url, reqs)
        sent, run.results[run.setup] = _measured_replay(original_replay, url, reqs)
        return sent

    trace_mod.replay = recording_replay
    _run_setups(args, run)


def _measured_replay(replay, url, reqs):
    """`replay(url, reqs)`, with CPU (per process, per thread, the system's) and vLLM's metrics
    taken around it: (what replay returned, the record)."""
    import psutil

    threads0 = thread_snapshot()
    cpu0, lines0, wall0, sys0 = cpu_snapshot(), vllm_metric_lines(), time.time(), \
        psutil.cpu_times()
    sent = replay(url, reqs)
    cpu1, sys1 = cpu_snapshot(), psutil.cpu_times()
    threads1 = thread_snapshot()
    time.sleep(3.0)
    lines1 = vllm_metric_lines()
    return sent, {
        "wall0": wall0, "wall1": time.time(),
        "sent": [{"i": s.index, "status": s.status, "sent_at_s": s.sent_at_s,
                  "ttft_s": s.ttft_s, "prompt_tokens": s.prompt_tokens,
                  "cached_tokens": s.cached_tokens, "error": s.error,
                  "engine_queue_ms": s.engine_queue_ms,
                  "engine_prefill_ms": s.engine_prefill_ms} for s in sent],
        "cpu": cpu_delta(cpu0, cpu1), "threads": thread_delta(threads0, threads1),
        "system_busy_s": round((sys1.user + sys1.system) - (sys0.user + sys0.system), 2),
        "system_idle_s": round(sys1.idle - sys0.idle, 2),
        "metrics_before": lines0, "metrics_after": lines1}


def _run_setups(args, run: _Round) -> None:
    """Each set-up of --setups on the round, one after another on one simulated cluster;
    results.json rewritten after each."""
    from ray import serve

    from cluster.tools.bench import vllm_serve as vs
    from cluster.tools.bench.vllm_serve_setups import ENGINE_SLOT
    from cluster.tools.outputs import write_text_atomic
    from cluster.tools.redis_server import free_port
    from cluster.tools.simcluster import simulated_cluster, start_serve

    out = Path(args.out)
    with simulated_cluster(vs.NUM_NODES, cpus_per_node=2, resources={ENGINE_SLOT: 1}):
        url = start_serve(free_port())
        for name in args.setups.split(","):
            run.setup = name
            began = time.time()
            summary = vs.run_setup(name, run.plan, run.model_dir, run.requests, url)
            run.results[name]["summary"] = summary["summary"]
            run.results[name]["start_s"] = summary["start_s"]
            run.results[name]["setup_total_s"] = time.time() - began
            write_text_atomic(out / "results.json", json.dumps(run.results, indent=1))
            print(name, json.dumps(summary["summary"]), flush=True)
        serve.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--setups", default="raykv,prefix")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--max-requests", type=int, default=0)
    parser.add_argument("--full", action="store_true", help="the full plan's round, not the "
                        "quick plan's")
    parser.add_argument("--saves", choices=SAVE_MODES, default="now",
                        help="when the connector's saver thread puts a save (an experiment: "
                        "'delay' holds each put back 50 ms, out of the reply's way; 'nice' "
                        "puts from a thread at nice 10)")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args)
    out = Path(args.out)
    (out / "events").mkdir(parents=True, exist_ok=True)
    from cluster.tools.bench.vllm_serve import CHILD_ENV
    compat = REPO / "cluster/tools/bench/vllm_compat"
    paths = [str(SITE), str(REPO), os.environ.get("PYTHONPATH")]
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": os.pathsep.join(filter(None, paths)),
           "RAYKV_PHASES_DIR": str(out / "events"), "RAYKV_PHASES_SAVES": args.saves,
           "RAYKV_PHASES_COMPAT": str(compat / "sitecustomize.py")}
    cmd = [sys.executable, "-m", "cluster.tools.bench.vllm_serve_phases.run", "--child",
           "--out", str(out),
           "--setups", args.setups, "--round", str(args.round),
           "--max-requests", str(args.max_requests), *(["--full"] if args.full else [])]
    script = "ip link set lo up && exec " + " ".join(cmd)
    isolate = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    return subprocess.run([*isolate, "sh", "-c", script], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
