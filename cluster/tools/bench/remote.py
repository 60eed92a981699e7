"""`raykv bench remote`: a cross-node get next to the wire it runs on and Ray's transfer.

Three simulated nodes (ray.cluster_utils.Cluster: a head C with the driver, workers A and B,
each its own raylet and object store, each a kv node). For 1 and 4 MiB pages, in one run, per
repetition (the first an untimed warm-up), in an order that rotates, B reads PROMPT_BYTES
that A holds:

    raykv remote get   client.get(tokens, out=out) on B of a prompt stored only on A: keys;
                       B's acquire (a miss) and the directory match, sent together; A's page
                       server sends the pages from its slab straight into out's rows. B's node
                       then pulls them (off the critical path; waited for, untimed).
    data plane alone   the same transport read (A's page server -> out), no Ray call
    raw TCP            A's process memory -> sendall -> recv_into a touched contiguous buffer
                       on B, one connection reused: the floor to match
    raw TCP into rows  the same raw stream scattered into out's page slices (512 runs per page
                       here): the layout a get fills, with no raykv code
    raw TCP, sendfile  the same bytes from a /dev/shm file with os.sendfile (a candidate)
    Ray objects        ray.get on B of pages ray.put on A beforehand + np.copyto of each

Every raykv repetition reads a fresh prompt (B keeps what it read, so a second get would be
local). Bytes are checked after every read, untimed. GB/s = prompt bytes / seconds.

Replication: A's prompt H is pulled to B by B's node actor (NodeCacheActor.pull, what the
control loop's replication calls), then H is read on B and on A by their clients, alternating,
REPLICA_READS times each after a warm-up: replicated_get_vs_local_get compares the two.

NIXL (when installed): the service restarts with transport="nixl" (4 MiB pages), so A's page
server answers both TCP reads and NIXL pushes. B reads the same prompt from it into out, over
TCP and over NIXL alternately (the order flips every round), NIXL_ROUNDS rounds after a
warm-up pair, with the same parallelism (the same lanes); nixl_vs_tcp is the median of the
rounds' (TCP seconds / NIXL seconds), i.e. NIXL's bytes/s over TCP's. UCX picks the path: on
this one-host cluster that is shared memory (CMA), not RDMA.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.handles import NodeHandle
from cluster.core.config import CacheConfig
from cluster.core.geometry import PageGeometry
from cluster.tools.bench import common
from cluster.tools.bench.remote_peer import SPEC, BenchPeer
from cluster.tools.bench.remote_report import NOTES, print_report

MiB = common.MiB
PAGE_MIB = (1, 4)
RATIO_PAGE_MIB = 4
PROMPT_BYTES = 64 * MiB
NUM_REPS = 7  # timed repetitions per page size; plus one warm-up
QUICK_NUM_REPS = 2
REPLICA_READS = 7
OBJECT_STORE_BYTES = 512 * MiB
LOCATE_TIMEOUT_S = 30.0
HOT_PROMPT = 1000
DATAPLANE_PROMPT = 1001
GOALS = {"remote_get_vs_tcp": {"min": 0.8}, "remote_get_vs_ray": {"min": 3.0},
         "replicated_get_vs_local_get": {"min": 0.9}}
NODES = ("bench_node_a", "bench_node_b", "bench_node_c")
NIXL_ROUNDS = 5  # timed pairs; at least 3 in a quick run too
CONTENDERS = ("raykv", "dataplane", "tcp", "tcp_rows", "sendfile", "ray")


def _service_config(page_bytes: int, num_reps: int, disk_dir: str,
                    transport: str = "tcp") -> CacheConfig:
    """Host tiers that hold every prompt of the run: A stores them all, B pulls each one."""
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, "a page must be whole tokens"
    # No control loop: its replication would copy prompts to B on its own, in the middle of
    # the timings, and before the explicit pull of the replicated case.
    return CacheConfig(page_tokens=page_tokens, device_bytes=0,
                       host_bytes=(num_reps + 4) * PROMPT_BYTES, disk_bytes=0,
                       eviction="lru", call_timeout_s=30.0, rebalance=False,
                       transport=transport,
                       disk_dir=os.path.join(disk_dir, f"{page_bytes // MiB}mib-{transport}"))


def _wait_located(reader, prompt: int, num_pages: int) -> None:
    """Until the directory lists the prompt (a commit does not wait for the event flush)."""
    deadline_s = time.monotonic() + LOCATE_TIMEOUT_S
    while ray.get(reader.located.remote(prompt)) < num_pages:
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"the directory did not list prompt {prompt}")
        time.sleep(0.01)


def _one_rep(roles: dict, rep: int) -> dict[str, float]:
    """Every contender once, in an order that rotates with the repetition."""
    writer, reader = roles["writer"], roles["reader"]
    refs = ray.get(writer.put_raw.remote(rep))
    figures: dict[str, float] = {}
    order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[: rep % len(CONTENDERS)]
    for name in order:
        if name == "raykv":
            figures.update(ray.get(reader.remote_get.remote(rep)))
        elif name == "dataplane":
            figures["dataplane"] = ray.get(reader.dataplane_s.remote(DATAPLANE_PROMPT,
                                                                      roles["endpoint"]))
        elif name == "tcp_rows":
            figures["tcp_rows"] = ray.get(reader.stream_rows_s.remote(roles["stream"]))
        elif name in ("tcp", "sendfile"):
            op = b"m" if name == "tcp" else b"s"
            figures[name] = ray.get(reader.stream_s.remote(roles["stream"], op))
        else:
            figures.update(ray.get(reader.get_raw.remote(refs)))
    del refs
    ray.get(writer.drop_raw.remote(rep))
    figures["control"] = ray.get(reader.control_s.remote(DATAPLANE_PROMPT))
    return figures


def _replicated(roles: dict, node_ids: dict, page_bytes: int) -> dict[str, float]:
    """Pull the hot prompt to B through B's node actor, then read it on A and on B."""
    writer, reader = roles["writer"], roles["reader"]
    keys = ray.get(writer.keys_of.remote(HOT_PROMPT))
    geometry = PageGeometry.of(SPEC, page_bytes // SPEC.bytes_per_token)
    b_node = NodeHandle.lookup(node_ids["b"], CacheConfig())
    pull_s, pulled = common.timed(lambda: ray.get(b_node.pull(geometry, {node_ids["a"]: keys})))
    if pulled != len(keys):
        raise RuntimeError(f"replication pulled {pulled} of {len(keys)} pages")
    ray.get([writer.get.remote(HOT_PROMPT), reader.get.remote(HOT_PROMPT)])  # warm-up
    local, replicated = [], []
    for _ in range(REPLICA_READS):
        local.append(ray.get(writer.get.remote(HOT_PROMPT)))
        replicated.append(ray.get(reader.get.remote(HOT_PROMPT)))
    return {"pull_s": pull_s, "local_get_s": statistics.median(local),
            "replicated_get_s": statistics.median(replicated),
            "ratio": common.median_ratio(local, replicated)}


def _size_figures(timed: list[dict[str, float]], replica: dict, memcpy_gbps: float) -> dict:
    ms = {name: statistics.median(f[name] for f in timed) * 1e3 for name in timed[0]}
    gbps = {name: PROMPT_BYTES / (value / 1e3) / 1e9 for name, value in ms.items()
            if name in CONTENDERS + ("remote_get", "ray_fetch")}
    gbps["replicated_get"] = PROMPT_BYTES / replica["replicated_get_s"] / 1e9
    gbps["local_get"] = PROMPT_BYTES / replica["local_get_s"] / 1e9
    gbps["memcpy"] = memcpy_gbps
    per_rep = lambda a, b: common.median_ratio([f[b] for f in timed],  # noqa: E731
                                               [f[a] for f in timed])
    return {"gbps": gbps, "ms": ms, "replication": replica, "per_rep_s": timed,
            "remote_get_p90_ms": common.percentile_ms((f["remote_get"] for f in timed), 90),
            "ratios": {"remote_get_vs_tcp": per_rep("remote_get", "tcp"),
                       "remote_get_vs_ray": per_rep("remote_get", "ray"),
                       "replicated_get_vs_local_get": replica["ratio"],
                       "dataplane_vs_tcp": per_rep("dataplane", "tcp"),
                       "tcp_rows_vs_tcp": per_rep("tcp_rows", "tcp"),
                       "dataplane_vs_tcp_rows": per_rep("dataplane", "tcp_rows"),
                       "sendfile_vs_tcp": per_rep("sendfile", "tcp"),
                       "remote_get_vs_dataplane": per_rep("remote_get", "dataplane")}}


def measure_size(page_mib: int, num_reps: int, disk_dir: str, roles: dict,
                 node_ids: dict) -> dict:
    from cluster import start

    page_bytes = page_mib * MiB
    writer, reader = roles["writer"], roles["reader"]
    common.stop_service()
    start(_service_config(page_bytes, num_reps, disk_dir))
    ray.get([writer.setup.remote(page_bytes, PROMPT_BYTES),
             reader.setup.remote(page_bytes, PROMPT_BYTES)])
    prompts = list(range(num_reps + 1)) + [HOT_PROMPT, DATAPLANE_PROMPT]
    put_s = ray.get([writer.put.remote(p) for p in prompts])
    num_pages = PROMPT_BYTES // page_bytes
    for prompt in prompts:
        _wait_located(reader, prompt, num_pages)
    roles["stream"] = ray.get(writer.serve_streams.remote())
    roles["endpoint"] = ray.get(NodeHandle.lookup(node_ids["a"], CacheConfig()).dataplane())
    per_rep = [_one_rep(roles, rep) for rep in range(num_reps + 1)]
    replica = _replicated(roles, node_ids, page_bytes)
    ray.get([writer.close_streams.remote(), reader.close_streams.remote()])
    figures = _size_figures(per_rep[1:], replica, ray.get(reader.memcpy_gbps.remote()))
    return {"page_tokens": page_bytes // SPEC.bytes_per_token, "pages_per_prompt": num_pages,
            "raykv_put_ms": statistics.median(put_s) * 1e3, **figures}


def measure_nixl(num_rounds: int, disk_dir: str, roles: dict, node_ids: dict) -> dict:
    """The same prompt from A's page server over TCP and over NIXL, in alternating pairs."""
    from cluster import start

    page_bytes = RATIO_PAGE_MIB * MiB
    writer, reader = roles["writer"], roles["reader"]
    common.stop_service()
    start(_service_config(page_bytes, 1, disk_dir, transport="nixl"))
    ray.get([writer.setup.remote(page_bytes, PROMPT_BYTES),
             reader.setup.remote(page_bytes, PROMPT_BYTES)])
    ray.get(writer.put.remote(DATAPLANE_PROMPT))
    _wait_located(reader, DATAPLANE_PROMPT, PROMPT_BYTES // page_bytes)
    endpoint = ray.get(NodeHandle.lookup(node_ids["a"], CacheConfig()).dataplane())
    why_not = ray.get(reader.nixl_up.remote())
    if endpoint.transport != "nixl" or why_not is not None:
        return {"skipped": why_not or "A's node serves TCP only (NIXL did not start there)"}
    read = lambda name: ray.get(reader.dataplane_s.remote(DATAPLANE_PROMPT, endpoint,  # noqa: E731
                                                          name))
    read("tcp"), read("nixl")  # warm-up: connections, staging buffers, UCX endpoints
    seconds: dict[str, list[float]] = {"tcp": [], "nixl": []}
    for round_index in range(num_rounds):
        for name in (("tcp", "nixl") if round_index % 2 == 0 else ("nixl", "tcp")):
            seconds[name].append(read(name))
    served = ray.get(NodeHandle.lookup(node_ids["a"], CacheConfig()).stats())["dataplane"]
    return {"page_mib": RATIO_PAGE_MIB, "rounds": num_rounds, "per_round_s": seconds,
            "gbps": {name: PROMPT_BYTES / statistics.median(values) / 1e9
                     for name, values in seconds.items()},
            "pushed_pages": served.get("pushed_pages", 0),
            "nixl_vs_tcp": common.median_ratio(seconds["tcp"], seconds["nixl"])}


def _nixl_installed() -> bool:
    from cluster.core.dataplane.nixl_agent import load_api

    try:
        load_api()
    except ImportError:
        return False
    return True


# ---- the cluster, ratios, report -----------------------------------------------------------


def _node_args(name: str) -> dict:
    return dict(num_cpus=1, resources={CacheConfig().node_resource: 1, name: 1},
                object_store_memory=OBJECT_STORE_BYTES)


def _start_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("raykv bench remote starts its own 3-node Ray cluster; "
                           "call ray.shutdown() first")
    cluster = Cluster(initialize_head=True,
                      head_node_args={**_node_args(NODES[2]), "include_dashboard": False})
    try:
        for name in NODES[:2]:
            cluster.add_node(**_node_args(name))
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        cluster.wait_for_nodes()
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    return cluster


def _node_of(resource: str) -> str:
    for node in ray.nodes():
        if node["Alive"] and node["Resources"].get(resource):
            return node["NodeID"]
    raise RuntimeError(f"no alive node offers {resource}")


def _peers_on_nodes() -> tuple[dict, dict]:
    """The writer on A and the reader on B; and the node ids."""
    node_ids = {"a": _node_of(NODES[0]), "b": _node_of(NODES[1])}
    roles = {role: BenchPeer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_ids[side], soft=False)).remote() for role, side in (("writer", "a"),
                                                                  ("reader", "b"))}
    placed = ray.get([roles["writer"].node_id.remote(), roles["reader"].node_id.remote()])
    assert placed == [node_ids["a"], node_ids["b"]], f"bench peers landed on {placed}"
    return roles, node_ids


def ratios_of(per_size: dict[str, dict]) -> dict[str, float]:
    main = per_size.get(f"{RATIO_PAGE_MIB}MiB") or next(iter(per_size.values()))
    ratios = dict(main["ratios"])
    for size, figures in per_size.items():
        if figures is not main:
            ratios.update({f"{name}_{size.lower()}": value
                           for name, value in figures["ratios"].items()})
    return ratios


def measure_sizes(num_reps: int, disk_dir: str) -> tuple[dict[str, dict], dict]:
    """Per page size, the contenders; then NIXL against TCP (skipped without NIXL)."""
    from rich.progress import Progress

    per_size: dict[str, dict] = {}
    roles, node_ids = _peers_on_nodes()
    with Progress() as progress:
        steps = common.Steps(progress, "remote", len(PAGE_MIB) + 1)
        for page_mib in PAGE_MIB:
            steps(f"{page_mib} MiB pages")
            per_size[f"{page_mib}MiB"] = measure_size(page_mib, num_reps, disk_dir, roles,
                                                      node_ids)
        steps("NIXL against TCP")
        nixl = (measure_nixl(NIXL_ROUNDS, disk_dir, roles, node_ids) if _nixl_installed()
                else {"skipped": "NIXL is not installed (pip install nixl)"})
    return per_size, nixl


def run(json_path: str | None, quick: bool) -> dict:
    num_reps = QUICK_NUM_REPS if quick else NUM_REPS
    machine = common.machine_info()
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-remote-", dir="/tmp")
    cluster = _start_cluster()
    try:
        per_size, nixl = measure_sizes(num_reps, disk_dir)
    finally:
        try:
            common.stop_service()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(disk_dir, ignore_errors=True)
    result = {"benchmark": "remote", "unit": "GB/s (1e9 B/s), ms",
              "ratio_basis": f"{RATIO_PAGE_MIB} MiB pages",
              "config": {"page_mib": list(PAGE_MIB), "prompt_bytes": PROMPT_BYTES,
                         "num_reps": num_reps, "warmup_reps": 1, "replica_reads": REPLICA_READS,
                         "object_store_bytes_per_node": OBJECT_STORE_BYTES, "nodes": 3,
                         "transport": CacheConfig().transport,
                         "top_tier": "host (device_bytes=0)", "quick": quick},
              "machine": machine, "per_size": per_size, "nixl": nixl,
              "ratios": {**ratios_of(per_size), "nixl_vs_tcp": nixl.get("nixl_vs_tcp")},
              "goals": GOALS, "notes": NOTES + (["quick run: fewer repetitions"] if quick
                                                else [])}
    print_report(result)
    return common.finish(result, json_path)
