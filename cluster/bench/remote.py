"""`raykv bench remote`: a cross-node get next to a raw Ray object transfer of the same bytes.

Two simulated nodes (ray.cluster_utils.Cluster: a head A and a worker B, each its own raylet
and object store, each a kv node). For each page size (1 and 4 MiB), in one run:

    raykv put         an actor on A puts NUM_PROMPTS distinct prompts of PROMPT_BYTES (untimed)
    raykv remote get  an actor on B: client.get(tokens, out=out) of each prompt, once, into a
                      preallocated touched tensor: keys, directory match, then B's node actor
                      pulls the pages from A's (read_pages, a Ray object) into B's host tier,
                      and the client copies them out of shared memory
    raw Ray           an actor on A ray.put()s the same number of numpy pages (untimed); the
                      actor on B times ray.get(refs) + copying each page into a touched buffer

Prompts alternate raykv-first and Ray-first. GB/s = prompt bytes / seconds, median over
prompts (after one untimed warm-up prompt each).

Where the remote get's time goes, per prompt (medians, ms), measured on the same prompts:

    local get         the same get again, now that the pages are on B: keys + match + acquire
                      RPC + copies out of /dev/shm                    (the local part)
    lookup            client.lookup: keys + match
    read A->B         ray.get(A's node actor.read_pages(keys)) from B: A pins and copies the
                      pages into fresh arrays, Ray stores the reply in A's object store and
                      moves it to B's                        (what a pull fetches, no store)
    read on A         the same read_pages call from an actor on A (no transfer)
    B store (rest)    remote get - local get - read A->B: B's node actor writing the pages
                      into its host tier, committing, telling the directory, and the extra RPCs
    what-if direct    read A->B + copying the arrived pages straight into `out` (the client
                      reading the Ray object itself; B's host tier filled off the critical path)
    what-if export    an RPC to the actor on A, which pins the pages and ray.puts them as one
                      object straight from their slots (one copy), then ray.get of that ref on
                      B and copies into `out`: one copy on each side, like raw Ray plus a put
    what-if pipelined the same in CHUNK_BYTES objects asked for at once: A's put of chunk i+1
                      overlaps the move of chunk i (timed whole, keys + match included)
    copy floor        the same per-page copies into `out` from private tensors, no Ray
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.bench import peers
from cluster.bench.directory import percentile_ms, stop_service
from cluster.bench.hashing import goals_met, machine_info
from cluster.config import CacheConfig
from cluster.spec import ModelSpec

MiB = 1 << 20
PAGE_MIB = (1, 4)
RATIO_PAGE_MIB = 4
PROMPT_BYTES = 32 * MiB
CHUNK_BYTES = 8 * MiB  # what-if pipelined export: pages per chunk object
NUM_PROMPTS = 6  # timed, per page size; plus one warm-up
QUICK_NUM_PROMPTS = 3
OBJECT_STORE_BYTES = 256 * MiB
TOKEN_STRIDE = 1 << 20  # prompt p's tokens start at p * TOKEN_STRIDE
# Llama-3.1-8B's KV geometry (128 KiB per token): a 1 MiB page is 8 tokens, 4 MiB is 32.
SPEC = ModelSpec("bench-remote-llama-3.1-8b", 32, 8, 128, "bfloat16")
GOALS = {"remote_get_vs_ray": {"min": 0.8}}
NODES = ("bench_node_a", "bench_node_b")


def _node_args(name: str) -> dict:
    return dict(num_cpus=1, resources={CacheConfig().node_resource: 1, name: 1},
                object_store_memory=OBJECT_STORE_BYTES)


def _prompt_tokens(page_tokens: int, prompt: int) -> np.ndarray:
    num_tokens = PROMPT_BYTES // SPEC.bytes_per_token
    assert num_tokens % page_tokens == 0, "a prompt must be whole pages"
    return np.arange(num_tokens, dtype=np.int64) + prompt * TOKEN_STRIDE


def _prompt_kv(page_bytes: int, page_tokens: int) -> torch.Tensor:
    """kv [L, 2, H, T, D] whose page i holds peers.page_pool's page i."""
    num_pages = PROMPT_BYTES // page_bytes
    pool = torch.from_numpy(peers.page_pool(page_bytes, num_pages))
    pages = pool.view(torch.bfloat16).view(num_pages, *SPEC.page_shape(page_tokens))
    num_tokens = num_pages * page_tokens
    return pages.permute(1, 2, 3, 0, 4, 5).reshape(SPEC.page_shape(num_tokens)).clone()


def _touched_like(kv: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(kv)
    out.view(torch.uint8).fill_(0xA5)
    return out


def _timed(run) -> tuple[float, object]:
    start_s = time.perf_counter()
    value = run()
    return time.perf_counter() - start_s, value


@ray.remote(num_cpus=0, max_restarts=0)
class BenchPeer:
    """A client on one node, as a Serve replica would hold: the writer on A, the reader on B."""

    def __init__(self) -> None:
        self.client = None
        self.raw: dict[int, list] = {}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self, page_bytes: int, writer: bool) -> None:
        """Connect to the running service (one per page size); allocate what the role needs:
        the writer the prompt's kv and raw pages, the reader touched destinations and the
        expected kv (for the check)."""
        from cluster import connect

        self.client = self.kv = self.out = self.pool = self.raw_out = None  # free the last
        self.client = connect(SPEC)
        self.page_bytes = page_bytes
        self.page_tokens = self.client.page_tokens
        self.num_pages = PROMPT_BYTES // page_bytes
        self.kv = _prompt_kv(page_bytes, self.page_tokens)
        if writer:
            self.pool = peers.page_pool(page_bytes, self.num_pages)
        else:
            self.out = _touched_like(self.kv)
            self.raw_out = peers.touched_buffer(page_bytes, self.num_pages)

    # ---- the writer (node A) -------------------------------------------------------------

    def put(self, prompt: int) -> float:
        tokens = _prompt_tokens(self.page_tokens, prompt)
        put_s, stored = _timed(lambda: self.client.put(tokens, self.kv))
        if stored != len(tokens):
            raise RuntimeError(f"put stored {stored} of {len(tokens)} tokens (tier full?)")
        return put_s

    def put_raw(self, batch: int) -> tuple[float, list, list]:
        """ray.put each page (as raykv's put, this is not the timed part), and all the pages
        as one object (a list of arrays); keep the refs."""
        put_s, refs = _timed(lambda: [ray.put(page) for page in self.pool])
        whole = [ray.put(list(self.pool))]
        self.raw[batch] = refs + whole
        return put_s, refs, whole

    def drop_raw(self, batch: int) -> None:
        self.raw.pop(batch, None)

    def export(self, prompt: int, first: int = 0, count: int | None = None) -> list:
        """What-if source side (not raykv's path): pin pages [first, first + count) of the
        prompt through shared memory, ray.put them as one object straight from their slots
        (one copy into the object store), unpin; returns [ref]."""
        client = self.client
        keys = client.keys(_prompt_tokens(self.page_tokens, prompt))
        keys = keys[first:] if count is None else keys[first:first + count]
        epoch, lease_id, slots = ray.get(client.local.acquire(client.geometry, keys))
        client.map_epoch(epoch)
        try:
            if len(slots) != len(keys):
                raise RuntimeError(f"export found {len(slots)} of {len(keys)} pages on A")
            return [ray.put([client._page_view(tier, slot).view(torch.uint8).numpy()
                             for tier, slot in slots])]
        finally:
            client.local.release(lease_id)

    def read_here(self, prompt: int) -> float:
        """read_pages from this node's own actor: the source side of a pull, no transfer."""
        return self._read(self.node_id(), prompt)[0]

    def _read(self, node_id: str, prompt: int) -> tuple[float, list]:
        from actors.handles import NodeHandle

        handle = NodeHandle.lookup(node_id, self.client.config)
        keys = self.client.keys(_prompt_tokens(self.page_tokens, prompt))
        read_s, pages = _timed(lambda: ray.get(handle.read_pages(self.client.geometry, keys)))
        if len(pages) != len(keys):
            raise RuntimeError(f"read_pages returned {len(pages)} of {len(keys)} pages")
        return read_s, pages

    # ---- the reader (node B) -------------------------------------------------------------

    def get(self, prompt: int, source_node: str, writer) -> dict[str, float]:
        """Seconds of: the remote get, the same get again (local), a lookup, read_pages from
        the source node, copying what read_pages returned into `out`, and the what-if export
        path (the writer's export, ray.get of its refs, copies into `out`)."""
        tokens = _prompt_tokens(self.page_tokens, prompt)
        figures = {}
        figures["remote_get"], (found, _) = _timed(lambda: self.client.get(tokens, out=self.out))
        if found != len(tokens):
            raise RuntimeError(f"remote get returned {found} of {len(tokens)} tokens")
        figures["local_get"], _ = _timed(lambda: self.client.get(tokens, out=self.out))
        figures["lookup"], _ = _timed(lambda: self.client.lookup(tokens))
        figures["read_remote"], pages = self._read(source_node, prompt)
        figures["direct_copy"], _ = _timed(lambda: self._copy_into_out(pages))
        pages = None  # free the last reply before the next move
        figures["export_rpc"], refs = _timed(lambda: ray.get(writer.export.remote(prompt)))
        figures["export_fetch"], pages = _timed(lambda: ray.get(refs[0]))
        figures["export_copy"], _ = _timed(lambda: self._copy_into_out(pages))
        pages = None  # free the last reply before the next move
        figures["pipelined_get"] = self.get_pipelined(prompt, writer)
        return figures

    def get_pipelined(self, prompt: int, writer) -> float:
        """What-if, timed whole: keys + match, then the writer exports the prompt in chunks of
        CHUNK_BYTES, all asked at once, so that A's put of chunk i+1 overlaps the move of
        chunk i to B; each chunk is copied into `out` as it arrives."""
        tokens = _prompt_tokens(self.page_tokens, prompt)
        chunk_pages = max(1, CHUNK_BYTES // self.page_bytes)
        start_s = time.perf_counter()
        if self.client.lookup(tokens) != len(tokens):
            raise RuntimeError("pipelined what-if: the prompt is not all in the directory")
        calls = [writer.export.remote(prompt, first, chunk_pages)
                 for first in range(0, self.num_pages, chunk_pages)]
        for index, call in enumerate(calls):
            self._copy_into_out(ray.get(ray.get(call)[0]), index * chunk_pages)
        return time.perf_counter() - start_s

    def _copy_into_out(self, pages: list[np.ndarray], first: int = 0) -> None:
        shape, tokens = self.client.geometry.shape, self.page_tokens
        for position, page in enumerate(pages, start=first):
            with warnings.catch_warnings():  # Ray hands back read-only arrays; we only read
                warnings.simplefilter("ignore", UserWarning)
                view = torch.from_numpy(page).view(torch.bfloat16).view(shape)
            self.out[:, :, :, position * tokens:(position + 1) * tokens].copy_(view)

    def get_raw(self, refs: list, whole: list) -> dict[str, float]:
        """ray.get of the pages (A -> B), then a copy of each into a touched buffer; then the
        same with all the pages in one object."""
        fetch_s, pages = _timed(lambda: ray.get(refs))
        copy_s, _ = _timed(lambda: self._copy_raw(pages))
        one_s, pages = _timed(lambda: ray.get(whole[0]))
        one_copy_s, _ = _timed(lambda: self._copy_raw(pages))
        return {"raw_get": fetch_s + copy_s, "raw_fetch": fetch_s, "raw_copy": copy_s,
                "raw_one_object": one_s + one_copy_s}

    def _copy_raw(self, pages: list[np.ndarray]) -> None:
        for i, page in enumerate(pages):
            np.copyto(self.raw_out[i], page)

    def copy_floor(self, reps: int = 5) -> float:
        """Median seconds of the get's per-page copies into `out` from private tensors."""
        tokens = self.page_tokens
        pages = [self.kv[:, :, :, p * tokens:(p + 1) * tokens].contiguous()
                 for p in range(self.num_pages)]

        def copy_all() -> None:
            for p, page in enumerate(pages):
                self.out[:, :, :, p * tokens:(p + 1) * tokens].copy_(page)

        copy_all()
        return statistics.median(_timed(copy_all)[0] for _ in range(reps))

    def memcpy_gbps(self) -> float:
        return peers.memcpy_gbps(self.page_bytes, self.num_pages)

    def check(self, prompt: int) -> None:
        """The prompt's bytes came back exactly (now a local get), and the raw copies too."""
        self.out.view(torch.uint8).fill_(0)
        found, _ = self.client.get(_prompt_tokens(self.page_tokens, prompt), out=self.out)
        if found * SPEC.bytes_per_token != PROMPT_BYTES:
            raise RuntimeError(f"check get returned {found} tokens")
        if not torch.equal(self.out.view(torch.int16), self.kv.view(torch.int16)):
            raise RuntimeError("a remote get returned different bytes than were put")
        peers.check_pool(self.raw_out)


# ---- one page size -------------------------------------------------------------------------


def _service_config(page_bytes: int, num_prompts: int, disk_dir: str) -> CacheConfig:
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, "a page must be whole tokens"
    return CacheConfig(page_tokens=page_tokens, device_bytes=0,
                       host_bytes=(num_prompts + 1) * PROMPT_BYTES, disk_bytes=0,
                       disk_dir=os.path.join(disk_dir, f"{page_bytes // MiB}mib"),
                       eviction="lru")


def _one_prompt(writer, reader, prompt: int, node_a: str) -> dict[str, float]:
    """raykv and raw Ray for one prompt, in an order that alternates with the prompt."""
    raw_put_s, refs, whole = ray.get(writer.put_raw.remote(prompt))
    figures: dict[str, float] = {"raw_put": raw_put_s}
    for part in (("raykv", "raw") if prompt % 2 else ("raw", "raykv")):
        if part == "raykv":
            figures.update(ray.get(reader.get.remote(prompt, node_a, writer)))
        else:
            figures.update(ray.get(reader.get_raw.remote(refs, whole)))
    del refs, whole
    ray.get(writer.drop_raw.remote(prompt))
    figures["read_here"] = ray.get(writer.read_here.remote(prompt))
    return figures


def _derived(figures: dict[str, float]) -> dict[str, float]:
    """One prompt's seconds plus the sums and differences (per prompt, before medians)."""
    f = dict(figures)
    f["direct_get"] = f["lookup"] + f["read_remote"] + f["direct_copy"]
    f["export_get"] = f["lookup"] + f["export_rpc"] + f["export_fetch"] + f["export_copy"]
    f["transfer"] = f["read_remote"] - f["read_here"]
    f["b_store_rest"] = f["remote_get"] - f["local_get"] - f["read_remote"]
    return f


def measure_size(page_mib: int, num_prompts: int, disk_dir: str, peers_by_role: dict,
                 node_a: str) -> dict:
    from cluster import start

    page_bytes = page_mib * MiB
    writer, reader = peers_by_role["writer"], peers_by_role["reader"]
    stop_service()
    start(_service_config(page_bytes, num_prompts, disk_dir))
    ray.get([writer.setup.remote(page_bytes, True), reader.setup.remote(page_bytes, False)])
    prompts = list(range(num_prompts + 1))  # prompt 0 warms up
    put_s = ray.get([writer.put.remote(p) for p in prompts])
    per_prompt = [_one_prompt(writer, reader, p, node_a) for p in prompts]
    ray.get(reader.check.remote(prompts[-1]))
    timed = [_derived(f) for f in per_prompt[1:]]
    ms = {name: statistics.median(f[name] for f in timed) * 1e3 for name in timed[0]}
    gbps = lambda name: PROMPT_BYTES / (ms[name] / 1e3) / 1e9  # noqa: E731
    ms["copy_floor"] = ray.get(reader.copy_floor.remote()) * 1e3
    ms["raykv_put"] = statistics.median(put_s[1:]) * 1e3
    return {"page_tokens": page_bytes // SPEC.bytes_per_token,
            "pages_per_prompt": PROMPT_BYTES // page_bytes,
            "remote_get_gbps": gbps("remote_get"), "local_get_gbps": gbps("local_get"),
            "raw_ray_gbps": gbps("raw_get"), "raw_fetch_gbps": gbps("raw_fetch"),
            "raw_one_object_gbps": gbps("raw_one_object"),
            "direct_get_gbps": gbps("direct_get"), "export_get_gbps": gbps("export_get"),
            "pipelined_get_gbps": gbps("pipelined_get"),
            "read_remote_gbps": gbps("read_remote"),
            "memcpy_gbps": ray.get(reader.memcpy_gbps.remote()),
            "remote_get_p90_ms": percentile_ms([f["remote_get"] for f in timed], 90),
            "raw_get_p90_ms": percentile_ms([f["raw_get"] for f in timed], 90),
            "ms": ms, "per_prompt_s": timed,
            "ratios": {"remote_get_vs_ray": gbps("remote_get") / gbps("raw_get"),
                       "local_get_vs_ray": gbps("local_get") / gbps("raw_get"),
                       "whatif_direct_get_vs_ray": gbps("direct_get") / gbps("raw_get"),
                       "whatif_export_get_vs_ray": gbps("export_get") / gbps("raw_get"),
                       "whatif_pipelined_get_vs_ray": gbps("pipelined_get") / gbps("raw_get")}}


# ---- the cluster, ratios, report -----------------------------------------------------------


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


def _peer_on(node_id: str):
    return BenchPeer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id, soft=False)).remote()


def ratios_of(per_size: dict[str, dict]) -> dict[str, float]:
    main = per_size.get(f"{RATIO_PAGE_MIB}MiB") or next(iter(per_size.values()))
    ratios = dict(main["ratios"])
    for size, figures in per_size.items():
        if figures is not main:
            ratios.update({f"{name}_{size.lower()}": value
                           for name, value in figures["ratios"].items()})
    ms = main["ms"]
    ratios["remote_get_transfer_share"] = ms["transfer"] / ms["remote_get"]
    return ratios


GBPS_ROWS = [("remote_get_gbps", "raykv remote get (A->B)"),
             ("raw_ray_gbps", "raw ray.get + copy (A->B)"),
             ("raw_fetch_gbps", "  of which ray.get alone"),
             ("raw_one_object_gbps", "raw, pages in one object"),
             ("local_get_gbps", "raykv get again (local)"),
             ("read_remote_gbps", "read_pages A->B, no store"),
             ("direct_get_gbps", "what-if: direct get"),
             ("export_get_gbps", "what-if: export get"),
             ("pipelined_get_gbps", "what-if: pipelined export"),
             ("memcpy_gbps", "memcpy (limit)")]
MS_ROWS = [("remote_get", "raykv remote get"), ("lookup", "  keys + match"),
           ("read_remote", "  read_pages A->B"), ("read_here", "    of which on A"),
           ("transfer", "    of which A->B move"), ("b_store_rest", "  B store + RPCs (rest)"),
           ("local_get", "  local get (same prompt)"), ("copy_floor", "    copy floor, no Ray"),
           ("raw_get", "raw ray.get + copy"), ("raw_fetch", "  ray.get"),
           ("raw_copy", "  copies"), ("raw_one_object", "raw, pages in one object"),
           ("direct_get", "what-if: direct get"),
           ("export_get", "what-if: export get"), ("export_rpc", "  export on A (RPC)"),
           ("export_fetch", "  ray.get of its refs"), ("export_copy", "  copies into out"),
           ("pipelined_get", "what-if: pipelined export"),
           ("raykv_put", "raykv put on A (untimed)"), ("raw_put", "ray.put on A (untimed)")]


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    sizes = list(result["per_size"])
    gbps = Table(title=f"cross-node get of a {PROMPT_BYTES // MiB} MiB prompt, GB/s (medians)")
    ms = Table(title="where the time goes, ms per prompt (medians)")
    for table in (gbps, ms):
        table.add_column("contender")
        for size in sizes:
            table.add_column(f"{size} page", justify="right")
    for key, label in GBPS_ROWS:
        gbps.add_row(label, *(f"{result['per_size'][s][key]:.2f}" for s in sizes))
    for key, label in MS_ROWS:
        ms.add_row(label, *(f"{result['per_size'][s]['ms'][key]:.1f}" for s in sizes))
    ratios = Table(title=f"ratios ({result['ratio_basis']})")
    for column in ("ratio", "value", "goal", "met"):
        ratios.add_column(column)
    for name, value in result["ratios"].items():
        goal = result["goals"].get(name)
        met = result["met"].get(name)
        ratios.add_row(name, f"{value:.3f}", f">= {goal['min']}" if goal else "",
                       "" if met is None else ("[green]yes[/]" if met else "[red]NO[/]"))
    console = Console()
    for table in (gbps, ms, ratios):
        console.print(table)


NOTES = [
    "two simulated nodes on one machine (ray.cluster_utils.Cluster, one raylet and object "
    "store each); A -> B moves go through Ray's object manager over loopback, not a NIC",
    f"remote_get_vs_ray: raykv remote get GB/s / raw Ray GB/s at {RATIO_PAGE_MIB} MiB pages "
    "(other sizes suffixed); each is the median over prompts of prompt bytes / seconds, timed "
    "in the actor on B; raw Ray = ray.get(refs of pages ray.put on A) + np.copyto of each "
    "page into a touched buffer",
    "raw, pages in one object: the same pages ray.put as one list (one object) on A, "
    "ray.get + copies on B: how much of the gap is one big reply object vs per-page objects",
    "local_get_vs_ray: the same raykv get again, now local (B's host tier), vs raw Ray",
    "whatif_direct_get_vs_ray (not what raykv does): keys + match + read_pages A->B + "
    "copying the arrived pages into out, i.e. the client reading the Ray object itself",
    "whatif_export_get_vs_ray (not what raykv does): keys + match + an RPC to the actor on A "
    "that pins the pages and ray.puts them (one object, a list of views of the shared-memory "
    "slots: one copy), then ray.get of that ref on B + copies into out: one copy on each "
    "side of the move",
    "whatif_pipelined_get_vs_ray (not what raykv does): the export what-if in CHUNK_BYTES "
    "objects, all asked for at once, so A's put of a chunk overlaps the move of the one "
    "before; timed whole in the actor on B, keys + match included",
    "ms rows (differences taken per prompt, then the median): transfer = read_pages A->B - "
    "read_pages on A; B store + RPCs = remote get - local get - read_pages A->B (B's node "
    "actor writes the pulled pages into its host tier, commits and flushes to the "
    "directory); remote_get_transfer_share = transfer / remote get",
    "the machine has 2 cores shared by both raylets, the actors and the copies: stages that "
    "could overlap on a bigger machine (the pipelined what-if) compete for CPU here",
    f"kv geometry: {SPEC.name}, bf16, 128 KiB per token: out's page slices are 512 strided "
    "runs (copy floor = those copies alone); raw Ray copies contiguous pages",
]


def run(json_path: str | None, quick: bool) -> dict:
    from rich.progress import Progress

    num_prompts = QUICK_NUM_PROMPTS if quick else NUM_PROMPTS
    machine = {**machine_info(), "torch_threads": torch.get_num_threads(),
               "loadavg_start": list(os.getloadavg())}
    per_size: dict[str, dict] = {}
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-remote-", dir="/tmp")
    cluster = _start_cluster()
    try:
        node_a, node_b = _node_of(NODES[0]), _node_of(NODES[1])
        roles = {"writer": _peer_on(node_a), "reader": _peer_on(node_b)}
        nodes = ray.get([roles["writer"].node_id.remote(), roles["reader"].node_id.remote()])
        assert nodes == [node_a, node_b], f"bench peers landed on {nodes}"
        with Progress() as progress:
            task = progress.add_task("remote", total=len(PAGE_MIB))
            for page_mib in PAGE_MIB:
                progress.update(task, description=f"{page_mib} MiB pages")
                per_size[f"{page_mib}MiB"] = measure_size(page_mib, num_prompts, disk_dir,
                                                          roles, node_a)
                progress.advance(task)
    finally:
        try:
            stop_service()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(disk_dir, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    ratios = ratios_of(per_size)
    result = {"benchmark": "remote", "unit": "GB/s (1e9 B/s), ms",
              "ratio_basis": f"{RATIO_PAGE_MIB} MiB pages",
              "config": {"page_mib": list(PAGE_MIB), "prompt_bytes": PROMPT_BYTES,
                         "num_prompts": num_prompts, "warmup_prompts": 1,
                         "object_store_bytes_per_node": OBJECT_STORE_BYTES,
                         "nodes": 2, "top_tier": "host (device_bytes=0)", "quick": quick},
              "machine": machine, "per_size": per_size, "ratios": ratios, "goals": GOALS,
              "met": goals_met(ratios, GOALS),
              "notes": NOTES + (["quick run: fewer prompts"] if quick else [])}
    print_report(result)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(result, file, indent=2)
    return result
