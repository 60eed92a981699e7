"""`raykv bench faults`: faults under load on 3 simulated nodes, the fuzzers, and the soak.

Set-up: a `ray.cluster_utils.Cluster` of 3 kv nodes (1 CPU each), a real redis-server for the
directory's write-behind, raykv, and the Serve app on 127.0.0.1 (one engine replica per node,
tiny-llama). The workload (faults_workload.py) runs through every fault: put threads with a
client each on the head node, a remote reader on a worker node, an HTTP thread. Each fault
(faults_inject.py) is injected in turn; its window runs from the injection until the
workload's operations succeed again (3 in a row of each kind that matters, at most
RECOVERY_WAIT_S). Then the fuzzers (cluster/tools/fuzz.py) and the soak
(soak.py) on a fresh service.

    wrong_bytes            pages (or HTTP texts) that came back other than put      goal 0
    client_errors          exceptions where a value was promised, non-OpenAI HTTP    goal 0
                           errors, fuzz failures
    fuzz_cases             client + HTTP fuzz cases run                             >= 10,000
    recovery_s_<fault>     injection -> the workload succeeds again                 <= 30 s
    stalled_writer_wrong_bytes  pages that changed under a writer stalled past its    goal 0
                           lease (the stalled_writer fault's window)
    stalled_writes         late writes that ran after their lease lapsed            >= 2
                           (none: the fault proved nothing, and the bench fails)
    soak_rss_growth        max over node actors and the client, after warm-up       < 5 %
    soak_leases, soak_reservations   left after the soak                            0
    soak_files_left        shm after stop + files and shm after purge()    0
    unauthenticated_reads  reads per attempt without the peer key (faults_security.py)   0
    cross_tenant_reads     reads per attempt with another namespace's credentials       0
                           (1 when no attempt was made or the control read failed)
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
from cluster.tools.bench.faults_workload import RemoteReader, Workload, recovery_s, remote_loop
from cluster.tools.bench.soak import leftovers_after_stop, run_soak

MODEL = "tiny-llama"
NUM_NODES = 3
RECOVERY_WAIT_S = 60.0
HTTP_PROMPTS = [f"Customer {i}: my kettle whistles before it boils. " * 4 for i in range(3)]
FUZZ_CASES = {"full": (6000, 4500), "quick": (600, 450)}
FAULTS = {**faults_inject.FAULTS, **faults_security.FAULTS}
NOTES = ("ops = workload operations started in the fault's window (a put read back, a get of "
         "an older prompt, a remote get, an HTTP completion); recovery_s = from the injection "
         "to the end of the first success after the last failure, over the kinds that matter "
         "for the fault (put + remote for KV faults, the re-put for client_mid_put, HTTP for "
         "serve_replica); full disk = ENOSPC injected on every disk write (RLIMIT_FSIZE does "
         "not bite: slab files are sized when opened); goals on recovery_s are ours; "
         "unauthenticated_reads and cross_tenant_reads = reads per attempt of the attacks "
         "of faults_security.py, from raw sockets on the driver to every page server (1 when "
         "no attempt was made or the victim's own read of the same keys found no page).")


def cache_config(disk_dir: str, redis_url: str | None):
    from cluster import CacheConfig

    return CacheConfig(page_tokens=16, device_bytes=0, host_bytes=4 * MiB, disk_bytes=16 * MiB,
                       disk_dir=disk_dir, redis_url=redis_url, rebalance=False,
                       reserve_lease_s=3.0, call_timeout_s=5.0)


def app_args() -> dict:
    return {"model": MODEL, "engine_num_cpus": 0, "max_ongoing_requests": 2,
            "max_queued_requests": 6, "max_context_tokens": 2048}


def _recovered(work: Workload, since_s: float, kinds: tuple[str, ...]) -> bool:
    """Each kind has 3 successes in a row, the last ones it recorded."""
    for kind in kinds:
        tail = [r.ok for r in work.records if r.kind == kind and r.start_s >= since_s][-3:]
        if len(tail) < 3 or not all(tail):
            return False
    return True


def run_fault(ctx: Context, name: str) -> dict:
    inject, kinds = FAULTS[name]
    work = ctx.workload
    injected_s = time.monotonic()
    extra = inject(ctx)
    undone_s = time.monotonic()
    while (not _recovered(work, undone_s, kinds)
           and time.monotonic() - injected_s < RECOVERY_WAIT_S):
        time.sleep(0.2)
    window = [r for r in list(work.records) if r.start_s >= injected_s]
    errors = sorted({r.error for r in window if r.error})
    return {"ops": len(window), "wrong_bytes": sum(r.wrong for r in window),
            "client_errors": sum(1 for r in window if r.error), "errors": errors[:3],
            "misses": sum(1 for r in window if not r.ok and not r.error),
            "recovery_s": recovery_s(window, injected_s, kinds),
            "window_s": time.monotonic() - injected_s, **extra}


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


def _reader_node(cluster, victim) -> str:
    return next(node.node_id for node in cluster.worker_nodes if node is not victim)


def _faults_part(cluster, redis, disk_dir: str, quick: bool, steps) -> dict:
    """The service, the Serve app and the workload, every fault in turn, then the fuzzers."""
    import ray
    import requests
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster import ModelSpec, connect, start
    from cluster.tools.redis_server import free_port
    from cluster.tools.simcluster import OBJECT_STORE_BYTES, deploy, start_serve

    config = cache_config(disk_dir, redis.url)
    spec = ModelSpec.preset(MODEL)
    start(config)
    steps("deploy the Serve app")
    url = start_serve(free_port())
    deploy(app_args())
    expected = {p: completion(requests, url, MODEL, p).json()["choices"][0]["text"]
                for p in HTTP_PROMPTS}
    victim = next(iter(cluster.worker_nodes))
    reader = RemoteReader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        _reader_node(cluster, victim), soft=False)).remote(spec)
    work = Workload(spec, num_threads=2, max_ops=10**6)
    work.start([remote_loop(reader, 30.0), http_loop(url, MODEL, expected)])
    node_args = {"num_cpus": 1, "resources": {"kv_node": 1},
                 "object_store_memory": OBJECT_STORE_BYTES}
    ctx = Context(cluster, node_args, victim, ray.get_runtime_context().get_node_id(),
                  config, redis, work, 2.0 if quick else 4.0, spec)
    time.sleep(3.0)  # warm: pages on disk, the remote reader's lag passed
    per_fault = {}
    for name in FAULTS:
        steps(f"fault: {name}")
        per_fault[name] = run_fault(ctx, name)
    work.stop()
    steps("fuzz")
    fuzz = run_fuzz(connect(spec), url, quick)
    return {"per_fault": per_fault, "fuzz": fuzz, "workload_ops": len(work.records)}


def _soak_part(disk_root: str, quick: bool, steps) -> dict:
    from ray import serve

    from cluster import ModelSpec, start

    steps("soak")
    serve.shutdown()
    common.stop_service()
    config = cache_config(tempfile.mkdtemp(prefix="soak-", dir=disk_root), None)
    start(config)
    soak = run_soak(ModelSpec.preset(MODEL), config, 30.0 if quick else 120.0)
    steps("stop and purge")
    return {**soak, **leftovers_after_stop(config)}


def ratios_of(faults: dict, soak: dict) -> dict[str, float]:
    per_fault = faults["per_fault"]
    ratios = {
        "wrong_bytes": float(sum(f["wrong_bytes"] for f in per_fault.values())
                             + soak["wrong_bytes"]),
        "client_errors": float(sum(f["client_errors"] for f in per_fault.values())
                               + soak["client_errors"] + faults["fuzz"]["failures"]),
        "fuzz_cases": float(faults["fuzz"]["cases"])}
    ratios.update({f"recovery_s_{name}": f["recovery_s"] for name, f in per_fault.items()})
    stalled = per_fault.get("stalled_writer", {})  # absent: 0 stalled writes, which fails
    ratios.update({"stalled_writer_wrong_bytes": float(stalled.get("wrong_bytes", 0)),
                   "stalled_writes": float(stalled.get("stalled_writes", 0))})
    ratios.update({name: faults_security.read_ratio(per_fault.get(fault, {}))
                   for name, fault in faults_security.RATIOS.items()})
    ratios.update({"soak_rss_growth": soak["rss_growth"], "soak_leases": float(soak["leases"]),
                   "soak_reservations": float(soak["reservations"]),
                   "soak_files_left": float(soak["files_left"])})
    return ratios


def goals_for(ratios: dict) -> dict:
    goals = {"wrong_bytes": {"max": 0}, "client_errors": {"max": 0},
             "fuzz_cases": {"min": 10_000}, "soak_rss_growth": {"max": 0.05},
             "soak_leases": {"max": 0}, "soak_reservations": {"max": 0},
             "soak_files_left": {"max": 0}, "stalled_writer_wrong_bytes": {"max": 0},
             "stalled_writes": {"min": 2}, "unauthenticated_reads": {"max": 0},
             "cross_tenant_reads": {"max": 0}}
    goals.update({name: {"max": 30.0} for name in ratios if name.startswith("recovery_s_")})
    return goals


def fault_table(per_fault: dict):
    rows = [[name, str(f["ops"]), str(f["wrong_bytes"]), str(f["client_errors"]),
             str(f["misses"]), f"{f['recovery_s']:.2f}"] for name, f in per_fault.items()]
    return common.table("faults under load", ["fault", "ops", "wrong", "client errors",
                                              "not ok", "recovery s"], rows)


def run(json_path: str | None, quick: bool) -> dict:
    from rich.progress import Progress

    from cluster.tools.redis_server import RedisServer
    from cluster.tools.simcluster import simulated_cluster

    result = {"benchmark": "faults", "unit": "counts and seconds", "machine":
              common.machine_info(), "config": {"quick": quick, "nodes": NUM_NODES,
                                                "faults": list(FAULTS)}, "notes": NOTES}
    disk_root = tempfile.mkdtemp(prefix="raykv-bench-faults-", dir="/tmp")
    try:
        with RedisServer() as redis, simulated_cluster(NUM_NODES) as cluster, \
                Progress() as progress:
            steps = common.Steps(progress, "faults", len(FAULTS) + 4)
            faults = _faults_part(cluster, redis, disk_root + "/faults", quick, steps)
            soak = _soak_part(disk_root, quick, steps)
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
        remove_stale_shm(slot_shm_prefix(disk_root + "/faults"))  # a removed node's slabs
    common.print_tables([fault_table(faults["per_fault"])])
    result.update({"faults": faults, "soak": soak})
    result["ratios"] = ratios_of(faults, soak)
    result["goals"] = goals_for(result["ratios"])
    return common.finish(result, json_path)
