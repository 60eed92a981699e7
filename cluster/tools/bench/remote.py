"""`raykv bench remote`: a cross-node get next to a raw Ray object transfer of the same bytes.

Two simulated nodes (ray.cluster_utils.Cluster: a head A and a worker B, each its own raylet
and object store, each a kv node). For each page size (1 and 4 MiB), in one run, per repetition
(the first one an untimed warm-up), with prompts of PROMPT_BYTES put by a client actor on A
beforehand (untimed), and read by a client actor on B:

    raykv remote get  client.get(tokens, out=out) on B of a prompt stored only on A: keys; B's
                      acquire (a miss) and the directory match sent together; A's export_pages
                      (A ray.put()s each page once, straight from its slot); ray.get of those
                      objects (moved A -> B); np.copyto of each page into `out`. B's node then
                      adopts the pages off the critical path (waited for, untimed).
    cached export     the same get of another prompt that A has exported already (its export
                      cache holds the objects, as when a second node reads a hot prefix)
    raw Ray           A ray.put()s the same number of numpy pages (untimed); B times ray.get of
                      the refs + np.copyto of each page into a touched buffer

Every repetition uses fresh prompts (B adopts what it fetched, so a second get would be local).
raykv and raw Ray alternate which goes first. GB/s = prompt bytes / seconds, median over
repetitions. `out` is zeroed before each get and compared byte for byte after it (untimed).

Where the remote get's time goes: on a third fresh prompt per repetition, B runs the get's
steps one at a time through the same calls the client makes, each timed: keys, acquire,
match, A's export_pages RPC (the put into A's object store), ray.get of the page objects (the
move A -> B), and the copies into `out`.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.core.config import CacheConfig
from cluster.tools.bench import common, peers

MiB = common.MiB
PAGE_MIB = (1, 4)
RATIO_PAGE_MIB = 4
PROMPT_BYTES = 32 * MiB
NUM_PROMPTS = 6  # timed repetitions per page size; plus one warm-up
QUICK_NUM_PROMPTS = 3
PROMPTS_PER_REP = 3  # cold get, cached-export get, steps
OBJECT_STORE_BYTES = 512 * MiB
ADOPT_TIMEOUT_S = 60.0
TOKEN_STRIDE = 1 << 20  # prompt p's tokens start at p * TOKEN_STRIDE
SPEC = common.LLAMA_8B_KV  # a 1 MiB page is 8 tokens, 4 MiB is 32
GOALS = {"remote_get_vs_ray": {"min": 0.8}}
NODES = ("bench_node_a", "bench_node_b")


def _prompt_tokens(prompt: int) -> np.ndarray:
    return np.arange(PROMPT_BYTES // SPEC.bytes_per_token, dtype=np.int64) + prompt * TOKEN_STRIDE


@ray.remote(num_cpus=0, max_restarts=0)
class BenchPeer:
    """A client on one node, as a Serve replica would hold: the writer on A, the reader on B."""

    def __init__(self) -> None:
        self.client = None
        self.raw: dict[int, list] = {}
        self.adopted_pages = 0

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self, page_bytes: int) -> None:
        """Connect to the running service (one per page size) and allocate touched buffers:
        the prompt's kv, `out` like it, and the raw pages and their destination."""
        from cluster import connect

        self.client = self.kv = self.out = self.pool = self.raw_out = None  # free the last
        self.client = connect(SPEC)
        self.num_pages = PROMPT_BYTES // page_bytes
        self.kv = common.page_kv(SPEC, self.client.page_tokens, self.num_pages)
        self.out = common.touched_like(self.kv)
        self.pool = peers.page_pool(page_bytes, self.num_pages)
        self.raw_out = peers.touched_buffer(page_bytes, self.num_pages)
        self.adopted_pages = ray.get(self.client.local.stats())["pulled_pages"]

    # ---- the writer (node A) -------------------------------------------------------------

    def put(self, prompt: int) -> float:
        tokens = _prompt_tokens(prompt)
        put_s, stored = common.timed(lambda: self.client.put(tokens, self.kv))
        if stored != len(tokens):
            raise RuntimeError(f"put stored {stored} of {len(tokens)} tokens (tier full?)")
        return put_s

    def put_raw(self, rep: int) -> list:
        """ray.put each page (the put side, untimed, as raykv's put); keep the refs."""
        self.raw[rep] = [ray.put(page) for page in self.pool]
        return self.raw[rep]

    def drop_raw(self, rep: int) -> None:
        self.raw.pop(rep, None)

    def export(self, prompt: int) -> int:
        """Have this node export the prompt's pages now (they stay in its export cache)."""
        keys = self.client.keys(_prompt_tokens(prompt))
        return len(ray.get(self.client.local.export_pages(self.client.geometry, keys)))

    # ---- the reader (node B) -------------------------------------------------------------

    def get(self, prompt: int) -> dict[str, float]:
        """Seconds of one client.get into `out` (zeroed before), then of the wait until this
        node's actor has adopted the fetched pages (off the get's critical path, but waited
        for so that it does not overlap the next measurement); `out` is checked last."""
        tokens = _prompt_tokens(prompt)
        self.out.zero_()
        get_s, (found, _) = common.timed(lambda: self.client.get(tokens, out=self.out))
        if found != len(tokens):
            raise RuntimeError(f"remote get returned {found} of {len(tokens)} tokens")
        self.adopted_pages += self.num_pages
        adopt_s = self._wait_adopted()
        common.check_same(self.out, self.kv, f"remote get of prompt {prompt}")
        return {"get": get_s, "adopt": adopt_s}

    def _wait_adopted(self) -> float:
        start_s = time.perf_counter()
        deadline_s = start_s + ADOPT_TIMEOUT_S
        while ray.get(self.client.local.stats())["pulled_pages"] < self.adopted_pages:
            if time.perf_counter() > deadline_s:
                raise RuntimeError(f"pages not adopted within {ADOPT_TIMEOUT_S:.0f} s")
            time.sleep(0.002)
        return time.perf_counter() - start_s

    def steps(self, prompt: int, source_node: str) -> dict[str, float]:
        """The remote get of a fresh prompt, one step at a time, each timed (seconds)."""
        client, timed = self.client, common.timed
        tokens = _prompt_tokens(prompt)
        figures: dict[str, float] = {}
        figures["keys"], keys = timed(lambda: client.keys(tokens))
        figures["acquire"], acquired = timed(
            lambda: ray.get(client.local.acquire(client.geometry, keys)))
        figures["match"], located = timed(lambda: client.locate_keys(keys))
        if acquired[2] or len(located) != len(keys):
            raise RuntimeError("steps: the prompt must be on A only, and all of it")
        peer = client.view.peers.get(source_node)
        figures["export"], page_refs = timed(
            lambda: ray.get(peer.export_pages(client.geometry, keys)))
        figures["fetch"], pages = timed(lambda: ray.get(page_refs))
        self.out.zero_()
        figures["copies"], _ = timed(lambda: self._copy_pages(pages))
        common.check_same(self.out, self.kv, f"steps of prompt {prompt}")
        return figures

    def _copy_pages(self, pages: list[np.ndarray]) -> None:
        """What fetch_prefix's _copy_remote does with the arrived pages."""
        from cluster.core.copies import copy_page
        from cluster.core.kvcheck import page_slices
        from cluster.core.tiers.memory import readonly_tensor

        dtype, shape = SPEC.torch_dtype(), self.client.geometry.shape
        for position, page in enumerate(pages):
            copy_page(self.out[:, :, :, page_slices(position, self.client.page_tokens)],
                      readonly_tensor(page).view(dtype).view(shape))

    def get_raw(self, refs: list) -> dict[str, float]:
        """ray.get of the pages (A -> B), then a copy of each into a touched buffer."""
        self.raw_out.fill(0)
        fetch_s, pages = common.timed(lambda: ray.get(refs))
        copy_s, _ = common.timed(lambda: self._copy_raw(pages))
        peers.check_pool(self.raw_out)
        return {"raw_get": fetch_s + copy_s, "raw_fetch": fetch_s, "raw_copy": copy_s}

    def _copy_raw(self, pages: list[np.ndarray]) -> None:
        for i, page in enumerate(pages):
            np.copyto(self.raw_out[i], page)

    def memcpy_gbps(self) -> float:
        return peers.memcpy_gbps(self.raw_out.shape[1], self.num_pages)


# ---- one page size -------------------------------------------------------------------------


def _service_config(page_bytes: int, num_prompts: int, disk_dir: str) -> CacheConfig:
    """Host tiers that hold every prompt of the run (A stores them all, B adopts two per
    repetition), and an export cache that holds a few prompts."""
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, "a page must be whole tokens"
    num_stored = PROMPTS_PER_REP * (num_prompts + 1) + 1
    return CacheConfig(page_tokens=page_tokens, device_bytes=0,
                       host_bytes=num_stored * PROMPT_BYTES, disk_bytes=0,
                       export_cache_bytes=4 * PROMPT_BYTES, eviction="lru",
                       disk_dir=os.path.join(disk_dir, f"{page_bytes // MiB}mib"))


def _raykv_gets(writer, reader, rep: int) -> dict[str, float]:
    """The cold remote get, then the cached-export one."""
    cold = ray.get(reader.get.remote(PROMPTS_PER_REP * rep))
    ray.get(writer.export.remote(PROMPTS_PER_REP * rep + 1))
    cached = ray.get(reader.get.remote(PROMPTS_PER_REP * rep + 1))
    return {"remote_get": cold["get"], "adopt": cold["adopt"], "cached_get": cached["get"]}


def _one_rep(writer, reader, rep: int, node_a: str) -> dict[str, float]:
    """raykv and raw Ray for one repetition, in an order that alternates, then the steps."""
    refs = ray.get(writer.put_raw.remote(rep))
    figures: dict[str, float] = {}
    for part in (("raykv", "raw") if rep % 2 else ("raw", "raykv")):
        if part == "raykv":
            figures.update(_raykv_gets(writer, reader, rep))
        else:
            figures.update(ray.get(reader.get_raw.remote(refs)))
    del refs
    ray.get(writer.drop_raw.remote(rep))
    steps = ray.get(reader.steps.remote(PROMPTS_PER_REP * rep + 2, node_a))
    figures.update({f"step_{name}": value for name, value in steps.items()})
    figures["steps_total"] = (steps["keys"] + max(steps["acquire"], steps["match"])
                              + steps["export"] + steps["fetch"] + steps["copies"])
    return figures


def _size_figures(timed: list[dict[str, float]], put_s: list[float]) -> dict:
    ms = {name: statistics.median(f[name] for f in timed) * 1e3 for name in timed[0]}
    ms["raykv_put"] = statistics.median(put_s) * 1e3
    gbps = lambda name: PROMPT_BYTES / (ms[name] / 1e3) / 1e9  # noqa: E731
    return {"remote_get_gbps": gbps("remote_get"), "cached_get_gbps": gbps("cached_get"),
            "raw_ray_gbps": gbps("raw_get"), "raw_fetch_gbps": gbps("raw_fetch"),
            "remote_get_p90_ms": common.percentile_ms((f["remote_get"] for f in timed), 90),
            "raw_get_p90_ms": common.percentile_ms((f["raw_get"] for f in timed), 90),
            "ms": ms, "per_prompt_s": timed,
            "ratios": {"remote_get_vs_ray": gbps("remote_get") / gbps("raw_get"),
                       "cached_get_vs_ray": gbps("cached_get") / gbps("raw_get"),
                       "export_share_of_remote_get": ms["step_export"] / ms["steps_total"]}}


def measure_size(page_mib: int, num_prompts: int, disk_dir: str, roles: dict,
                 node_a: str) -> dict:
    from cluster import start

    page_bytes = page_mib * MiB
    writer, reader = roles["writer"], roles["reader"]
    common.stop_service()
    start(_service_config(page_bytes, num_prompts, disk_dir))
    ray.get([writer.setup.remote(page_bytes), reader.setup.remote(page_bytes)])
    put_s = ray.get([writer.put.remote(p) for p in range(PROMPTS_PER_REP * (num_prompts + 1))])
    per_rep = [_one_rep(writer, reader, rep, node_a) for rep in range(num_prompts + 1)]
    return {"page_tokens": page_bytes // SPEC.bytes_per_token,
            "pages_per_prompt": PROMPT_BYTES // page_bytes,
            "memcpy_gbps": ray.get(reader.memcpy_gbps.remote()),
            **_size_figures(per_rep[1:], put_s[PROMPTS_PER_REP:])}


# ---- the cluster, ratios, report -----------------------------------------------------------


def _node_args(name: str) -> dict:
    return dict(num_cpus=1, resources={CacheConfig().node_resource: 1, name: 1},
                object_store_memory=OBJECT_STORE_BYTES)


def _start_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("raykv bench remote starts its own 2-node Ray cluster; "
                           "call ray.shutdown() first")
    cluster = Cluster(initialize_head=True,
                      head_node_args={**_node_args(NODES[0]), "include_dashboard": False})
    try:
        cluster.add_node(**_node_args(NODES[1]))
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


def _peers_on_nodes() -> tuple[dict, str]:
    """The writer on A and the reader on B; and A's node id."""
    node_a, node_b = _node_of(NODES[0]), _node_of(NODES[1])
    roles = {role: BenchPeer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote() for role, node in (("writer", node_a), ("reader", node_b))}
    nodes = ray.get([roles["writer"].node_id.remote(), roles["reader"].node_id.remote()])
    assert nodes == [node_a, node_b], f"bench peers landed on {nodes}"
    return roles, node_a


def ratios_of(per_size: dict[str, dict]) -> dict[str, float]:
    main = per_size.get(f"{RATIO_PAGE_MIB}MiB") or next(iter(per_size.values()))
    ratios = dict(main["ratios"])
    for size, figures in per_size.items():
        if figures is not main:
            ratios.update({f"{name}_{size.lower()}": value
                           for name, value in figures["ratios"].items()})
    return ratios


GBPS_ROWS = [("remote_get_gbps", "raykv remote get (A->B)"),
             ("cached_get_gbps", "raykv remote get, export cached"),
             ("raw_ray_gbps", "raw ray.get + copy (A->B)"),
             ("raw_fetch_gbps", "  of which ray.get alone"), ("memcpy_gbps", "memcpy on B")]
MS_ROWS = [("remote_get", "raykv remote get"), ("steps_total", "  its steps, one at a time"),
           ("step_keys", "    keys"), ("step_acquire", "    B's acquire (a miss)"),
           ("step_match", "    directory match"), ("step_export", "    A's export_pages RPC"),
           ("step_fetch", "    ray.get of the pages"), ("step_copies", "    copies into out"),
           ("adopt", "B adopts (off the critical path)"),
           ("cached_get", "raykv get, export cached"), ("raw_get", "raw ray.get + copy"),
           ("raw_fetch", "  ray.get"), ("raw_copy", "  copies"),
           ("raykv_put", "raykv put on A (untimed)")]


def print_report(result: dict) -> None:
    sizes = list(result["per_size"])
    header = ["contender", *(f"{size} page" for size in sizes)]
    per_size = result["per_size"]
    common.print_tables([
        common.table(f"cross-node get of a {PROMPT_BYTES // MiB} MiB prompt, GB/s (medians)",
                     header, ([label, *(f"{per_size[s][key]:.2f}" for s in sizes)]
                              for key, label in GBPS_ROWS)),
        common.table("where the time goes, ms per prompt (medians)", header,
                     ([label, *(f"{per_size[s]['ms'][key]:.1f}" for s in sizes)]
                      for key, label in MS_ROWS))])


NOTES = [
    "two simulated nodes on one machine (ray.cluster_utils.Cluster, one raylet and object "
    "store each); A -> B moves go through Ray's object manager over loopback, not a NIC",
    f"remote_get_vs_ray: raykv remote get GB/s / raw Ray GB/s at {RATIO_PAGE_MIB} MiB pages "
    "(other sizes suffixed); each is the median over repetitions of prompt bytes / seconds, "
    "timed in the actor on B; raw Ray = ray.get(refs of pages ray.put on A beforehand) + "
    "np.copyto of each page into a touched buffer; raykv's get includes A's export (its "
    "ray.put of each page from the slot), raw Ray's put is not timed",
    "cached_get_vs_ray: the same get of a prompt A has already exported (its export cache "
    "holds the page objects), so the put into A's object store is not on the get's path",
    "steps (ms, medians): the remote get of a third fresh prompt, one call at a time: keys, "
    "B's acquire (a miss), the directory match (a real get sends these two together: "
    "steps_total counts the longer), A's export_pages RPC, ray.get of the page objects, "
    "np.copyto into out; export_share_of_remote_get = export / steps_total",
    "adopt: from the get's return until B's node actor reports the fetched pages adopted "
    "(polled every 2 ms; off the critical path, waited for so it does not overlap the next "
    "measurement)",
    "the machine has 2 cores shared by both raylets, the actors and the copies",
    f"kv geometry: {SPEC.name}, bf16, 128 KiB per token: out's page slices are 512 strided "
    "runs; raw Ray copies contiguous pages",
]


def measure_sizes(num_prompts: int, disk_dir: str) -> dict[str, dict]:
    from rich.progress import Progress

    per_size: dict[str, dict] = {}
    roles, node_a = _peers_on_nodes()
    with Progress() as progress:
        steps = common.Steps(progress, "remote", len(PAGE_MIB))
        for page_mib in PAGE_MIB:
            steps(f"{page_mib} MiB pages")
            per_size[f"{page_mib}MiB"] = measure_size(page_mib, num_prompts, disk_dir, roles,
                                                      node_a)
    return per_size


def run(json_path: str | None, quick: bool) -> dict:
    num_prompts = QUICK_NUM_PROMPTS if quick else NUM_PROMPTS
    machine = common.machine_info()
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-remote-", dir="/tmp")
    cluster = _start_cluster()
    try:
        per_size = measure_sizes(num_prompts, disk_dir)
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
                         "num_prompts": num_prompts, "warmup_prompts": 1,
                         "object_store_bytes_per_node": OBJECT_STORE_BYTES,
                         "nodes": 2, "top_tier": "host (device_bytes=0)", "quick": quick},
              "machine": machine, "per_size": per_size, "ratios": ratios_of(per_size),
              "goals": GOALS, "notes": NOTES + (["quick run: fewer prompts"] if quick else [])}
    print_report(result)
    return common.finish(result, json_path)
