"""`raykv bench remote`: moving a prompt's pages between nodes, raykv against the raw wire and Ray.

Three simulated nodes (ray.cluster_utils.Cluster: a head C with the driver, workers A and B,
each its own raylet and object store, each a kv node). A holds the prompts; B reads them.
raykv's TCP reader splits a read of a prompt into LANES runs of pages on as many connections
(cluster/core/dataplane/reader.py: 2 lanes for a read of >= 8 MiB); the raw TCP baseline opens
the same number of connections and receives them on the same number of threads. Per page size,
harness.interleave runs every contender once per round, in rotating order, after one untimed
warm-up call each:

    raykv              client.get(tokens, out=out) on B of a fresh prompt held only on A: keys;
                       B's acquire (a miss) and the directory match; A's page server sends the
                       pages over the lanes straight into out's rows. Untimed after it: B's node
                       pulls what the get read (off the get's path), and the control plane alone
    replication        B's node actor pulls a fresh prompt of A's into its host tier
                       (NodeCacheActor.pull, what the control loop's replication calls), timed
                       until the call returns, when the pages are resident on B; untimed after
                       it, a get on B must find every page there, with the bytes that were put
    tcp                raw TCP: A's process memory -> sendall -> recv_into a touched contiguous
                       buffer on B, over as many connections and threads as raykv's lanes
    tcp_rows           the same raw streams scattered into out's page slices (the layout a get
                       fills), no raykv code: what the layout alone costs
    dataplane          raykv's transport alone (A's page server -> out), no Ray call
    ray                what a user would run instead: ray.get on B of pages ray.put on A (the
                       put untimed, as raykv's put is), then a copy of each into a touched buffer

Every figure is GB/s = bytes moved / seconds; every read's bytes are checked, untimed. Ratios
are Report.paired medians of per-round ratios (raykv / baseline), with their spread:
remote_get_vs_tcp, remote_get_vs_ray and replication_vs_tcp have goals; the first two fail
unless every get read all its pages from A, the third unless every pull moved them all.

NIXL (when it starts): the service restarts with transport="nixl" (4 MiB pages), and B reads
one prompt from A's page server into out over TCP and over NIXL (the same lanes), interleaved;
nixl_vs_tcp (no goal) is NIXL's GB/s over TCP's. Where NIXL is missing or does not push, the
notes say so and the ratio is left out. UCX picks the path: on one host, shared memory (CMA).
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.handles import NodeHandle
from cluster.core.config import CacheConfig
from cluster.tools.bench import common
from cluster.tools.bench.harness import Report, interleave
from cluster.tools.bench.remote_peer import SPEC, BenchPeer
from cluster.tools.bench.remote_report import NOTES, print_report

MiB = common.MiB
RATIO_PAGE_MIB = 4
OBJECT_STORE_BYTES = 512 * MiB
LOCATE_TIMEOUT_S = 60.0
REPLICA_BASE = 100  # the replicated prompts are 100, 101, ...; the read ones 0, 1, ...
DATAPLANE_PROMPT = 1000
NODES = ("bench_node_a", "bench_node_b", "bench_node_c")
GOALS = {"remote_get_vs_tcp": {"min": 0.8}, "remote_get_vs_ray": {"min": 3.0},
         "replication_vs_tcp": {"min": 0.8}}
# ratio -> (raykv's contender, the baseline, what must have happened in every round)
RATIOS = {"remote_get_vs_tcp": ("raykv", "tcp", "remote"),
          "remote_get_vs_ray": ("raykv", "ray", "remote"),
          "replication_vs_tcp": ("replication", "tcp", "replicated"),
          "dataplane_vs_tcp": ("dataplane", "tcp", None),
          "tcp_rows_vs_tcp": ("tcp_rows", "tcp", None),
          "remote_get_vs_dataplane": ("raykv", "dataplane", "remote")}
NOT_EXERCISED = {
    "remote": "a get read fewer than all of its pages from node A: not a cross-node read",
    "replicated": "a replication pull moved fewer than all of the prompt's pages, or B did "
                  "not hold them all afterwards"}


@dataclass(frozen=True, slots=True)
class Plan:
    """Page sizes (the ratio size first), the prompt each read moves, and the rounds."""

    page_mib: tuple[int, ...]
    prompt_bytes: int
    num_rounds: int

    def get_prompt(self, round_index: int) -> int:
        """The prompt B reads in a round (round num_rounds is the warm-up)."""
        return round_index

    def replica_prompt(self, round_index: int) -> int:
        return REPLICA_BASE + round_index

    @property
    def prompts(self) -> list[int]:
        """Every prompt A stores: fresh ones per round and warm-up, for reads and pulls (B
        keeps what it read or pulled), and the one the data plane alone reads again."""
        rounds = range(self.num_rounds + 1)
        return [*map(self.get_prompt, rounds), *map(self.replica_prompt, rounds),
                DATAPLANE_PROMPT]


FULL = Plan(page_mib=(RATIO_PAGE_MIB, 1), prompt_bytes=64 * MiB, num_rounds=7)
QUICK = Plan(page_mib=(RATIO_PAGE_MIB,), prompt_bytes=32 * MiB, num_rounds=3)


@dataclass(frozen=True, slots=True)
class Roles:
    """The writer actor on A, the reader on B, their nodes, and the slabs' directory."""

    writer: object
    reader: object
    node_ids: dict
    disk_dir: str


def _service_config(plan: Plan, page_bytes: int, disk_dir: str,
                    transport: str = "tcp") -> CacheConfig:
    """Host tiers that hold every prompt of the run twice over (A stores them all, B reads
    or pulls nearly all): nothing is evicted (slabs are filled on demand)."""
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, "a page must be whole tokens"
    # No control loop: its replication would copy prompts to B on its own, mid-timing.
    return CacheConfig(page_tokens=page_tokens, device_bytes=0,
                       host_bytes=2 * len(plan.prompts) * plan.prompt_bytes, disk_bytes=0,
                       eviction="lru", call_timeout_s=30.0, rebalance=False,
                       transport=transport,
                       disk_dir=os.path.join(disk_dir, f"{page_bytes // MiB}mib-{transport}"))


def _start(plan: Plan, page_bytes: int, roles: Roles, transport: str = "tcp") -> int:
    """A fresh service; both peers connected. Returns the lanes raykv reads a prompt with."""
    from cluster import start

    common.stop_service()
    start(_service_config(plan, page_bytes, roles.disk_dir, transport))
    return ray.get([roles.writer.setup.remote(page_bytes, plan.prompt_bytes),
                    roles.reader.setup.remote(page_bytes, plan.prompt_bytes)])[1]


def _put_located(roles: Roles, prompts: list[int], num_pages: int) -> list[float]:
    """Put the prompts on A, one by one, each until the directory lists it (a commit does
    not wait for the event flush). Returns the puts' seconds."""
    put_s = []
    for prompt in prompts:
        put_s.append(ray.get(roles.writer.put.remote(prompt)))
        deadline_s = time.monotonic() + LOCATE_TIMEOUT_S
        while (located := ray.get(roles.reader.located.remote(prompt))) < num_pages:
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"the directory lists {located} of prompt {prompt}'s "
                                   f"{num_pages} pages {LOCATE_TIMEOUT_S:.0f} s after its put")
            time.sleep(0.01)
    return put_s


def _contenders(plan: Plan, roles: Roles, site: dict,
                phases: dict[str, list]) -> dict[str, Callable[[int], float]]:
    """name -> run one round (its index), return GB/s; raykv's phases go into `phases`."""
    reader, gigabytes = roles.reader, plan.prompt_bytes / 1e9

    def raykv(round_index: int) -> float:
        figures = ray.get(reader.remote_get.remote(plan.get_prompt(round_index),
                                                   DATAPLANE_PROMPT))
        for name in ("remote_pages", "adopt_s", "control_s"):
            phases[name].append(figures[name])
        return gigabytes / figures["s"]

    def replication(round_index: int) -> float:
        figures = ray.get(reader.replicate.remote(plan.replica_prompt(round_index),
                                                  roles.node_ids["a"]))
        phases["replicated_pages"].append(figures["pulled"])
        phases["resident_pages"].append(figures["resident"])
        return figures["pulled"] * site["page_bytes"] / 1e9 / figures["s"]

    def ray_objects(_: int) -> float:
        refs = ray.get(roles.writer.put_raw.remote())
        return gigabytes / ray.get(reader.get_raw.remote(refs))

    def stream(into_rows: bool) -> Callable[[int], float]:
        return lambda _: gigabytes / ray.get(reader.stream_s.remote(
            site["stream"], site["lanes"], into_rows))

    return {"raykv": raykv, "replication": replication, "tcp": stream(False),
            "tcp_rows": stream(True), "ray": ray_objects,
            "dataplane": lambda _: gigabytes / ray.get(reader.dataplane_s.remote(
                DATAPLANE_PROMPT, site["endpoint"]))}


def exercised_of(phases: dict[str, list], num_pages: int) -> dict[str, bool]:
    """Whether every round read all its pages from A, and whether every pull moved them all
    and left them resident on B."""
    whole = lambda name: all(count == num_pages for count in phases[name])  # noqa: E731
    return {"remote": whole("remote_pages"),
            "replicated": whole("replicated_pages") and whole("resident_pages")}


def size_ratios(report: Report, gbps: dict[str, list[float]], exercised: dict[str, bool],
                suffix: str) -> None:
    """Every ratio of RATIOS, paired by round; null and failed where not exercised."""
    for name, (raykv, baseline, needs) in RATIOS.items():
        report.paired(name + suffix, gbps[raykv], gbps[baseline])
        if needs:
            report.require(name + suffix, exercised[needs], NOT_EXERCISED[needs])


def measure_size(plan: Plan, page_mib: int, roles: Roles, report: Report) -> dict:
    """Every contender at one page size, interleaved; its ratios go into `report`."""
    page_bytes, num_pages = page_mib * MiB, plan.prompt_bytes // (page_mib * MiB)
    site = {"page_bytes": page_bytes, "lanes": _start(plan, page_bytes, roles)}
    put_s = _put_located(roles, plan.prompts, num_pages)
    site["stream"] = ray.get(roles.writer.serve_streams.remote())
    site["endpoint"] = ray.get(NodeHandle.lookup(roles.node_ids["a"], CacheConfig()).dataplane())
    phases: dict[str, list] = {name: [] for name in (
        "remote_pages", "adopt_s", "control_s", "replicated_pages", "resident_pages")}
    contenders = _contenders(plan, roles, site, phases)
    for contender in contenders.values():
        contender(plan.num_rounds)  # warm-up: connections, buffers, the first pull
    for values in phases.values():
        values.clear()
    gbps = interleave(contenders, plan.num_rounds)
    ray.get([roles.writer.close_streams.remote(), roles.reader.close_streams.remote()])
    suffix = "" if page_mib == RATIO_PAGE_MIB else f"_{page_mib}mib"
    size_ratios(report, gbps, exercised_of(phases, num_pages), suffix)
    return {"page_tokens": page_bytes // SPEC.bytes_per_token, "pages_per_prompt": num_pages,
            "lanes": site["lanes"], "raykv_put_ms": statistics.median(put_s) * 1e3,
            "gbps": common.medians(gbps), "rounds_gbps": gbps,
            "phases_ms": {name: statistics.median(phases[name]) * 1e3
                          for name in ("adopt_s", "control_s")},
            "pages_per_round": {name: phases[name] for name in (
                "remote_pages", "replicated_pages", "resident_pages")}}


def measure_nixl(plan: Plan, roles: Roles, report: Report) -> dict:
    """One prompt from A's page server over TCP and over NIXL, interleaved."""
    if not _nixl_installed():
        return _nixl_not_run(report, "NIXL is not installed (pip install nixl)")
    page_bytes, reader = RATIO_PAGE_MIB * MiB, roles.reader
    num_pages = plan.prompt_bytes // page_bytes
    lanes = _start(plan, page_bytes, roles, transport="nixl")
    _put_located(roles, [DATAPLANE_PROMPT], num_pages)
    a_node = NodeHandle.lookup(roles.node_ids["a"], CacheConfig())
    endpoint = ray.get(a_node.dataplane())
    why_not = ray.get(reader.nixl_up.remote())
    if endpoint.transport != "nixl" or why_not is not None:
        return _nixl_not_run(report, why_not or "A's node serves TCP only (NIXL did not start)")

    def read(transport: str) -> Callable[[int], float]:
        return lambda _: plan.prompt_bytes / 1e9 / ray.get(reader.dataplane_s.remote(
            DATAPLANE_PROMPT, endpoint, transport))

    contenders = {"tcp": read("tcp"), "nixl": read("nixl")}
    for contender in contenders.values():
        contender(-1)  # warm-up: connections, staging buffers, UCX endpoints
    pushed_before = _pushed_pages(a_node)
    gbps = interleave(contenders, plan.num_rounds)
    pushed = _pushed_pages(a_node) - pushed_before
    if pushed < plan.num_rounds * num_pages:
        return _nixl_not_run(report, f"A pushed {pushed} of the {plan.num_rounds * num_pages} "
                                     "pages read over NIXL: the rest went over TCP")
    report.paired("nixl_vs_tcp", gbps["nixl"], gbps["tcp"])
    return {"page_mib": RATIO_PAGE_MIB, "lanes": lanes, "rounds_gbps": gbps,
            "gbps": common.medians(gbps), "pushed_pages": pushed}


def _pushed_pages(node: NodeHandle) -> int:
    return ray.get(node.stats())["dataplane"].get("pushed_pages", 0)


def _nixl_not_run(report: Report, why: str) -> dict:
    report.note(f"nixl_vs_tcp not run: {why}")
    return {"skipped": why}


def _nixl_installed() -> bool:
    from cluster.core.dataplane.nixl_agent import load_api

    try:
        load_api()
    except ImportError:
        return False
    return True


# ---- the cluster ---------------------------------------------------------------------------


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


def _roles(disk_dir: str) -> Roles:
    """The writer on A and the reader on B."""
    node_ids = {"a": _node_of(NODES[0]), "b": _node_of(NODES[1])}
    writer, reader = (BenchPeer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_ids[side], soft=False)).remote() for side in ("a", "b"))
    placed = ray.get([writer.node_id.remote(), reader.node_id.remote()])
    assert placed == [node_ids["a"], node_ids["b"]], f"bench peers landed on {placed}"
    return Roles(writer, reader, node_ids, disk_dir)


def measure_all(plan: Plan, disk_dir: str, report: Report) -> tuple[dict[str, dict], dict]:
    """Per page size, the contenders; then NIXL against TCP (where NIXL runs)."""
    from rich.progress import Progress

    roles, per_size = _roles(disk_dir), {}
    with Progress() as progress:
        steps = common.Steps(progress, "remote", len(plan.page_mib) + 1)
        for page_mib in plan.page_mib:
            steps(f"{page_mib} MiB pages")
            per_size[f"{page_mib}MiB"] = measure_size(plan, page_mib, roles, report)
        steps("NIXL against TCP")
        nixl = measure_nixl(plan, roles, report)
        report["phase_s"] = steps.laps()
    return per_size, nixl


def run(json_path: str | None, quick: bool, **_extra) -> dict:
    plan = QUICK if quick else FULL
    config = {"page_mib": list(plan.page_mib), "prompt_bytes": plan.prompt_bytes,
              "num_rounds": plan.num_rounds, "warmup_rounds": 1, "nodes": 3,
              "object_store_bytes_per_node": OBJECT_STORE_BYTES,
              "transport": CacheConfig().transport, "top_tier": "host (device_bytes=0)",
              "quick": quick}
    report = Report("remote", "GB/s (1e9 B/s)", config, GOALS, NOTES)
    report["ratio_basis"] = f"{RATIO_PAGE_MIB} MiB pages"
    report.note(f"workload: a {plan.prompt_bytes >> 20} MiB prompt per read and per pull "
                f"({SPEC.name}, {SPEC.bytes_per_token >> 10} KiB per token), pages of "
                f"{', '.join(f'{m} MiB' for m in plan.page_mib)}, {plan.num_rounds} rounds "
                "after one warm-up" + (" (quick: a smaller prompt, one page size)"
                                       if quick else ""))
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-remote-", dir="/tmp")
    cluster = _start_cluster()
    try:
        report["per_size"], report["nixl"] = measure_all(plan, disk_dir, report)
    finally:
        try:
            common.stop_service()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(disk_dir, ignore_errors=True)
    print_report(report.result)
    return report.finish(json_path)
