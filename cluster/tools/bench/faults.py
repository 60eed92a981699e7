"""`raykv bench faults`: faults under load on 3 simulated nodes, the fuzzers, and the soak.

Set-up: a `ray.cluster_utils.Cluster` of 3 kv nodes (1 CPU each), a real redis-server for the
directory's write-behind, raykv, and the Serve app on 127.0.0.1 (one engine replica per node,
tiny-llama). The workload (faults_workload.py) runs through every fault: put threads with a
client each on the head node, a remote reader on a worker node, an HTTP thread. Each fault
(faults_inject.py, faults_security.py) is injected in turn; its window runs from the
injection until the workload's operations succeed again (3 in a row of each kind that
matters, at most RECOVERY_WAIT_S). Then the fuzzers (cluster/tools/fuzz.py) and the soak
(soak.py) on a fresh service.

    wrong_bytes            pages (or HTTP texts) that came back other than put, over     0
                           every operation of the run (in flight at a fault, between
                           windows, the soak's)
    client_errors          exceptions where a value was promised, non-OpenAI HTTP         0
                           errors, dead workload threads, fuzz failures; every operation
    fuzz_cases             client + HTTP fuzz cases run                         a count, no goal
    recovery_s_<fault>     injection -> the workload succeeds again             <= 30 s
                           (not exercised: no operation of its kinds in the window; for
                           flipped_disk_bytes and torn_write, also when the head node's
                           disk_checksum_failures did not rise: no damaged page was read)
    stalled_writer_wrong_bytes  pages that changed under a writer stalled past its    0
                           lease (the stalled_writer fault's window; not exercised when no
                           late write ran after its lease lapsed)
    stalled_writes         late writes that ran after their lease lapsed        >= 2
    unauthenticated_reads  reads per attempt without the peer key (faults_security.py)   0
    cross_tenant_reads     reads per attempt with another namespace's credentials       0
                           (both not exercised: no attempt, or the control read failed)
    soak_rss_growth        max over node actors and the client, after warm-up   <= 5 %
    soak_leases, soak_reservations   left after the soak                        0
    soak_files_left        shm after stop + files and shm after purge()         0
                           (the soak's ratios: not exercised when it ran no operation)

Every ratio that nothing exercised is null and fails the run (harness.Report.require).
"""

from __future__ import annotations

import shutil
import tempfile
import time

from cluster.core.config import MiB
from cluster.core.tiers.memory import remove_stale_shm
from cluster.core.tiers.node_slot import slot_shm_prefix
from cluster.tools.bench import common, faults_inject, faults_security
from cluster.tools.bench.faults_inject import Context, completion, http_loop
from cluster.tools.bench.faults_workload import (
    PROMPT_TOKENS,
    THREAD_KINDS,
    Record,
    RemoteReader,
    Workload,
    in_window,
    recovery_s,
    remote_loop,
    tally,
)
from cluster.tools.bench.harness import Report
from cluster.tools.bench.soak import leftovers_after_stop, run_soak

MODEL = "tiny-llama"
NUM_NODES = 3
NUM_PUT_THREADS = 2
RECOVERY_WAIT_S = 60.0
HTTP_PROMPTS = [f"Customer {i}: my kettle whistles before it boils. " * 4 for i in range(3)]
FUZZ_CASES = {"full": (6000, 4500), "quick": (600, 450)}
HOLD_S = {"full": 4.0, "quick": 2.0}
SOAK_S = {"full": 120.0, "quick": 30.0}
FAULTS = {**faults_inject.FAULTS, **faults_security.FAULTS}
GOALS = {"wrong_bytes": {"max": 0}, "client_errors": {"max": 0},
         **{f"recovery_s_{name}": {"max": 30.0} for name in FAULTS},
         "stalled_writer_wrong_bytes": {"max": 0}, "stalled_writes": {"min": 2},
         "unauthenticated_reads": {"max": 0}, "cross_tenant_reads": {"max": 0},
         "soak_rss_growth": {"max": 0.05}, "soak_leases": {"max": 0},
         "soak_reservations": {"max": 0}, "soak_files_left": {"max": 0}}
SOAK_RATIOS = {"soak_rss_growth": "rss_growth", "soak_leases": "leases",
               "soak_reservations": "reservations", "soak_files_left": "files_left"}
NOTES = ("ops = workload operations that overlapped the fault's window, those in flight at "
         "the injection included (a put read back, a get of an older prompt, a remote get, "
         "an HTTP completion, the fault's own checked puts and gets); wrong_bytes and "
         "client_errors sum every operation of the run (run + soak), not only the windows; "
         "recovery_s = from the injection to the end of the first success after the last "
         "failure, over the kinds that matter for the fault (put + remote for KV faults, the "
         "re-put for client_mid_put, HTTP for serve_replica); full disk = ENOSPC injected on "
         "every disk write (RLIMIT_FSIZE does not bite: slab files are sized when opened); "
         "flipped_disk_bytes and torn_write wait (at most 30 s) for the head node's "
         "disk_checksum_failures to rise, and fail when it did not; goals on recovery_s are "
         "ours; unauthenticated_reads and cross_tenant_reads = reads per attempt of the "
         "attacks of faults_security.py, from raw sockets on the driver to every page server.")


def cache_config(disk_dir: str, redis_url: str | None):
    from cluster import CacheConfig

    return CacheConfig(page_tokens=16, device_bytes=0, host_bytes=4 * MiB, disk_bytes=16 * MiB,
                       disk_dir=disk_dir, redis_url=redis_url, rebalance=False,
                       reserve_lease_s=3.0, call_timeout_s=5.0)


def app_args() -> dict:
    return {"model": MODEL, "engine_num_cpus": 0, "max_ongoing_requests": 2,
            "max_queued_requests": 6, "max_context_tokens": 2048}


def workload_note(quick: bool) -> str:
    mode = "quick" if quick else "full"
    config = cache_config("", None)
    return (f"workload: {NUM_PUT_THREADS} put threads on the head node, each a put of a fresh "
            f"{PROMPT_TOKENS}-token prompt ({MODEL}, {config.page_tokens}-token pages) read "
            f"back, then a get of an older prompt; a remote reader on a worker node every "
            f"0.2 s; greedy 4-token HTTP completions every 0.05 s; per node host "
            f"{config.host_bytes // MiB} MiB, disk {config.disk_bytes // MiB} MiB; held "
            f"faults last {HOLD_S[mode]:g} s; fuzz {sum(FUZZ_CASES[mode])} cases planned; "
            f"soak {SOAK_S[mode]:g} s with {NUM_PUT_THREADS} put threads")


def _recovered(records: list[Record], injected_s: float, undone_s: float,
               kinds: tuple[str, ...]) -> bool:
    """Each kind's last 3 operations succeeded: 3 started after the fault was undone, for the
    workload threads' kinds; since the injection, for those the fault itself records."""
    for kind in kinds:
        since_s = undone_s if kind in THREAD_KINDS else injected_s
        tail = [r.ok for r in records if r.kind == kind and r.start_s >= since_s][-3:]
        if len(tail) < 3 or not all(tail):
            return False
    return True


def run_fault(ctx: Context, name: str) -> tuple[dict, tuple[float, float]]:
    """Inject, wait for recovery; (the fault's own figures, its window's (start, end))."""
    inject, kinds = FAULTS[name]
    work = ctx.workload
    injected_s = time.monotonic()
    extra = inject(ctx)
    undone_s = time.monotonic()
    while (not _recovered(list(work.records), injected_s, undone_s, kinds)
           and time.monotonic() - injected_s < RECOVERY_WAIT_S):
        time.sleep(0.2)
    end_s = time.monotonic()
    return {"window_s": end_s - injected_s, **extra}, (injected_s, end_s)


def window_figures(records: list[Record], window: tuple[float, float],
                   kinds: tuple[str, ...]) -> dict:
    """A fault's tally and recovery_s over the records that overlapped its window (taken once
    the workload stopped, so that operations in flight at either end are in)."""
    overlapping = in_window(records, *window)
    return {**tally(overlapping), "recovery_s": recovery_s(overlapping, window[0], kinds)}


def run_fuzz(client, url: str, quick: bool) -> dict:
    """The fuzzers of cluster/tools/fuzz.py against the client and the HTTP app."""
    from cluster.tools import fuzz

    num_client, num_http = FUZZ_CASES["quick" if quick else "full"]
    cases, failures = 0, []
    for name, call in (("client", lambda: fuzz.run_client_fuzz(client, num_client)),
                       ("http", lambda: fuzz.run_http_fuzz(url, None, num_http))):
        try:
            cases += call()
        except AssertionError as error:
            failures.append(f"{name}: {error}")
    return {"cases": cases, "failures": len(failures), "failure_text": failures}


def _context(cluster, redis, config, work: Workload, quick: bool) -> Context:
    import ray

    from cluster import ModelSpec
    from cluster.tools.simcluster import OBJECT_STORE_BYTES

    node_args = {"num_cpus": 1, "resources": {"kv_node": 1},
                 "object_store_memory": OBJECT_STORE_BYTES}
    return Context(cluster, node_args, next(iter(cluster.worker_nodes)),
                   ray.get_runtime_context().get_node_id(), config, redis, work,
                   HOLD_S["quick" if quick else "full"], ModelSpec.preset(MODEL))


def _start_workload(cluster, url: str, victim) -> Workload:
    """The put threads, the remote reader (on a worker node that "node" does not remove) and
    the HTTP thread, whose expected texts are the app's answers before any fault."""
    import requests
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster import ModelSpec

    spec = ModelSpec.preset(MODEL)
    expected = {p: completion(requests, url, MODEL, p).json()["choices"][0]["text"]
                for p in HTTP_PROMPTS}
    reader_node = next(node.node_id for node in cluster.worker_nodes if node is not victim)
    reader = RemoteReader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        reader_node, soft=False)).remote(spec)
    work = Workload(spec, num_threads=NUM_PUT_THREADS, max_ops=10**6)
    work.start([remote_loop(reader, 30.0), http_loop(url, MODEL, expected)])
    return work


def _faults_part(cluster, redis, disk_dir: str, quick: bool, steps) -> dict:
    """The service, the Serve app and the workload, every fault in turn, then the fuzzers."""
    from cluster import ModelSpec, connect, start
    from cluster.tools.redis_server import free_port
    from cluster.tools.simcluster import deploy, start_serve

    config = cache_config(disk_dir, redis.url)
    start(config)
    steps("deploy the Serve app")
    url = start_serve(free_port())
    deploy(app_args())
    work = _start_workload(cluster, url, next(iter(cluster.worker_nodes)))
    ctx = _context(cluster, redis, config, work, quick)
    time.sleep(3.0)  # warm: pages on disk, the remote reader's lag passed
    per_fault, windows = {}, {}
    for name in FAULTS:
        steps(f"fault: {name}")
        per_fault[name], windows[name] = run_fault(ctx, name)
    work.stop()
    records = list(work.records)
    for name, window in windows.items():
        per_fault[name].update(window_figures(records, window, FAULTS[name][1]))
    steps("fuzz")
    fuzz = run_fuzz(connect(ModelSpec.preset(MODEL)), url, quick)
    return {"per_fault": per_fault, "fuzz": fuzz, "run": tally(records)}


def _soak_part(disk_root: str, quick: bool, steps) -> dict:
    from ray import serve

    from cluster import ModelSpec, start

    steps("soak")
    serve.shutdown()
    common.stop_service()
    config = cache_config(tempfile.mkdtemp(prefix="soak-", dir=disk_root), None)
    start(config)
    soak = run_soak(ModelSpec.preset(MODEL), config, SOAK_S["quick" if quick else "full"],
                    NUM_PUT_THREADS)
    steps("stop and purge")
    return {**soak, **leftovers_after_stop(config)}


def _count(report: Report, name: str, value, exercised: bool, why: str) -> None:
    if report.require(name, exercised, why):
        report.ratio(name, value)


def _recovery(report: Report, name: str, figures: dict) -> None:
    """recovery_s_<name>: not exercised without an operation of its kinds in the window, or,
    for a fault that damages pages on disk, when no damaged page was read."""
    ratio, kinds = f"recovery_s_{name}", FAULTS[name][1]
    if not report.require(ratio, figures.get("recovery_s") is not None,
                          f"no {'/'.join(kinds)} operation in the fault's window"):
        return
    _count(report, ratio, figures["recovery_s"], figures.get("checksum_failures", 1) > 0,
           "the head node's disk_checksum_failures did not rise: no damaged page was read")


def fill_ratios(report: Report, faults: dict, soak: dict) -> None:
    """Every ratio of the run into `report`; the counts over every operation of the run."""
    run, per_fault, fuzz = faults["run"], faults["per_fault"], faults["fuzz"]
    ran, why = run["ops"] > 0 and soak["ops"] > 0, "the workload or the soak ran no operation"
    _count(report, "wrong_bytes", run["wrong_bytes"] + soak["wrong_bytes"], ran, why)
    _count(report, "client_errors",
           run["client_errors"] + soak["client_errors"] + fuzz["failures"], ran, why)
    report.ratio("fuzz_cases", fuzz["cases"])  # a count, reported; no goal
    for name in FAULTS:
        _recovery(report, name, per_fault.get(name, {}))
    stalled = per_fault.get("stalled_writer", {})
    writes = stalled.get("stalled_writes", 0)
    _count(report, "stalled_writer_wrong_bytes", stalled.get("wrong_bytes", 0), writes > 0,
           "no late write ran after its lease lapsed")
    report.ratio("stalled_writes", writes)
    for ratio, fault in faults_security.RATIOS.items():
        value = faults_security.read_ratio(per_fault.get(fault, {}))
        _count(report, ratio, value, value is not None,
               "no attempt was made, or the victim's own read of the keys found no page")
    for ratio, key in SOAK_RATIOS.items():
        _count(report, ratio, soak.get(key), soak["ops"] > 0, "the soak ran no operation")


def fault_table(per_fault: dict):
    rows = [[name, str(f["ops"]), str(f["wrong_bytes"]), str(f["client_errors"]),
             str(f["misses"]), "-" if f["recovery_s"] is None else f"{f['recovery_s']:.2f}"]
            for name, f in per_fault.items()]
    return common.table("faults under load", ["fault", "ops", "wrong", "client errors",
                                              "not ok", "recovery s"], rows)


def run(json_path: str | None, quick: bool, **_extra) -> dict:
    from rich.progress import Progress

    from cluster.tools.redis_server import RedisServer
    from cluster.tools.simcluster import simulated_cluster

    config = {"quick": quick, "nodes": NUM_NODES, "faults": list(FAULTS)}
    report = Report("faults", "counts and seconds", config, GOALS,
                    [workload_note(quick), NOTES])
    disk_root = tempfile.mkdtemp(prefix="raykv-bench-faults-", dir="/tmp")
    try:
        with RedisServer() as redis, simulated_cluster(NUM_NODES) as cluster, \
                Progress() as progress:
            steps = common.Steps(progress, "faults", len(FAULTS) + 4)
            faults = _faults_part(cluster, redis, disk_root + "/faults", quick, steps)
            soak = _soak_part(disk_root, quick, steps)
            report["phase_s"] = steps.laps()
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
        remove_stale_shm(slot_shm_prefix(disk_root + "/faults"))  # a removed node's slabs
    common.print_tables([fault_table(faults["per_fault"])])
    report["faults"], report["soak"] = faults, soak
    fill_ratios(report, faults, soak)
    return report.finish(json_path)
