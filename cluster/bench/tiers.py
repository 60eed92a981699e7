"""`raykv bench tiers`: raykv's host and disk tiers next to the machine's limits and peers.

For each page size (1, 4, 16 MiB), in one run, the same batch of pages (BATCH_BYTES) moves:

    memcpy            np.copyto page by page, touched buffers       (limit of a host get/put)
    raykv host get    client.get(tokens, out=out) from this process: directory RPC, node
                      acquire RPC, one copy per page from the /dev/shm slab into `out`
    raykv host put    client.put(tokens, kv) of fresh pages: reserve RPC, copy, commit RPC
    fio read/write    O_DIRECT psync, block = page, numjobs = disk_threads     (disk limit)
    disk tier         DiskArena.write_pages / read_pages, same page, batch and threads, into
                      4096-aligned buffers: what demotion and promotion run
    disk end to end   the same service once its host tier is full: a put demotes a batch to
                      disk, a get reads a batch up from disk (and demotes another)
    redis             pipelined SET / GET of the pages                   (peer, loopback TCP)
    ray               ray.put / ray.get + copy, in-process and from another worker (peer)

Host figures are taken in ROUNDS, each round timing memcpy right before raykv, and the ratio
is the median of the per-round ratios: the machine is shared, and a noisy neighbour then
slows both sides of a ratio alike. All figures are GB/s (1e9 B/s) of page bytes.

Ray: when none is running, this starts a private local one (address="local"), so that it
never attaches to another process's cluster; it stops the service and that Ray at the end.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from cluster.bench import peers
from cluster.bench.hashing import goals_met, machine_info
from cluster.config import CacheConfig
from cluster.spec import ModelSpec

MiB = 1 << 20
PAGE_MIB = (1, 4, 16)
QUICK_PAGE_MIB = (1, 4)
RATIO_PAGE_MIB = 4
BATCH_BYTES = 64 * MiB
QUICK_BATCH_BYTES = 32 * MiB
ROUNDS = 3
QUICK_ROUNDS = 2
GET_REPS = 5  # per round
PUT_REPS = 2  # per round; each put needs fresh slots, so the host tier is sized for all
DISK_REPS = 5  # at least this many batches per disk tier measurement
ARENA_MIN_S = 0.6  # ... and at least this long
DISK_ROUNDS = 2  # at RATIO_PAGE_MIB (fio takes FIO_RUNTIME_S a run); one at other sizes
DISK_FILE_BYTES = 256 * MiB  # fio's file and the disk arena's capacity
HOST_SPARE_BATCHES = 3  # host tier: batch 0, the warm-up put, one spare, then the timed puts
E2E_PUTS = 7  # disk end to end: puts after measure_host (all but the first demote a batch)
E2E_GETS = 4  # timed gets of batches on disk (after one untimed, checked)
TOKEN_STRIDE = 1 << 24  # batch b's tokens start at b * TOKEN_STRIDE
OBJECT_STORE_BYTES = 768 * MiB
DISK_HEADER_BYTES = 4096
# Llama-3.1-8B's KV geometry (128 KiB per token), so pages are 8, 32 and 128 tokens.
SPEC = ModelSpec("bench-llama-3.1-8b", 32, 8, 128, "bfloat16")
GOALS = {
    "host_get_vs_memcpy": {"min": 0.6},
    "host_put_vs_memcpy": {"min": 0.5},
    "disk_read_vs_raw": {"min": 0.85},
    "disk_write_vs_raw": {"min": 0.85},
    "host_get_vs_redis": {"min": 10.0},
    "host_get_vs_ray": {"min": 1.5},
}


@dataclass(frozen=True, slots=True)
class SizePlan:
    page_bytes: int
    page_tokens: int
    num_pages: int  # pages in one batch (one put or get call)
    rounds: int  # host rounds
    disk_rounds: int
    disk_dir: str

    @property
    def batch_tokens(self) -> int:
        return self.num_pages * self.page_tokens

    @property
    def disk_slot_bytes(self) -> int:
        return DISK_HEADER_BYTES + self.page_bytes


def plan_for(page_mib: int, quick: bool, disk_dir: str) -> SizePlan:
    page_bytes = page_mib * MiB
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, f"{page_mib} MiB is not whole tokens"
    batch_bytes = QUICK_BATCH_BYTES if quick else BATCH_BYTES
    disk_rounds = DISK_ROUNDS if page_mib == RATIO_PAGE_MIB and not quick else 1
    return SizePlan(page_bytes, page_tokens, max(1, batch_bytes // page_bytes),
                    QUICK_ROUNDS if quick else ROUNDS, disk_rounds, disk_dir)


def _median_s(run: Callable[[], object], reps: int) -> float:
    times_s = []
    for _ in range(reps):
        start_s = time.perf_counter()
        run()
        times_s.append(time.perf_counter() - start_s)
    return statistics.median(times_s)


# ---- the service ---------------------------------------------------------------------------


def _ensure_ray() -> bool:
    """Start a private local Ray unless one is initialised; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address="local", resources={CacheConfig().node_resource: 1},
             include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             logging_level=logging.WARNING, log_to_driver=False)
    return True


def _stop_service() -> None:
    """stop(), wait until the named actors are gone (so that the next start() creates fresh
    ones), then unlink any /dev/shm slab this node's actor left behind."""
    import ray

    from actors.handles import CONTROLLER_NAME, DIRECTORY_NAME, NODE_NAME
    from cluster import stop
    from cluster.tiers.memory import remove_stale_shm

    stop()
    node_id = ray.get_runtime_context().get_node_id()
    names = [DIRECTORY_NAME.format(shard=0), NODE_NAME.format(node_id=node_id), CONTROLLER_NAME]
    deadline_s = time.monotonic() + 30.0
    while time.monotonic() < deadline_s:
        alive = []
        for name in names:
            try:
                alive.append(ray.get_actor(name, namespace=CacheConfig().ray_namespace))
            except ValueError:
                pass
        if not alive:
            break
        time.sleep(0.1)
    remove_stale_shm(f"raykv-{node_id[:12]}")


def _start_service(config: CacheConfig):
    from cluster import connect, start

    _stop_service()
    start(config)
    return connect(SPEC)


def _service_config(plan: SizePlan, host_pages: int, disk_pages: int, name: str) -> CacheConfig:
    """device_bytes=0: the host tier (host_pages slots) is the top tier."""
    return CacheConfig(page_tokens=plan.page_tokens, device_bytes=0,
                       host_bytes=host_pages * plan.page_bytes,  # pages are 4096-aligned
                       disk_bytes=max(disk_pages, 2) * plan.disk_slot_bytes, eviction="lru",
                       disk_dir=os.path.join(plan.disk_dir, f"{name}-{plan.page_bytes // MiB}mib"),
                       disk_codec="none")


def _tokens(plan: SizePlan, batch: int) -> np.ndarray:
    return np.arange(plan.batch_tokens, dtype=np.int64) + batch * TOKEN_STRIDE


@dataclass(slots=True)
class Session:
    """The service for one page size, a client of it, and one batch's kv and out tensors."""

    plan: SizePlan
    client: object
    kv: object  # torch.Tensor [L, 2, H, batch_tokens, D]; page i holds page_pool's page i
    out: object  # a touched tensor of the same shape
    num_batches: int = 0  # batches put so far: batch b has tokens _tokens(plan, b)

    def put_batch(self) -> None:
        """Put the next fresh batch; raise unless all its pages were stored."""
        stored = self.client.put(_tokens(self.plan, self.num_batches), self.kv)
        self.num_batches += 1
        if stored != self.plan.batch_tokens:
            raise RuntimeError(f"put stored {stored} of {self.plan.batch_tokens} tokens")

    def get_batch(self, batch: int) -> None:
        num_tokens, _ = self.client.get(_tokens(self.plan, batch), out=self.out)
        if num_tokens != self.plan.batch_tokens:
            raise RuntimeError(f"get returned {num_tokens} of {self.plan.batch_tokens} tokens")

    def check_batch(self, batch: int) -> None:
        """Get a batch into a zeroed out and compare every byte with what was put."""
        import torch

        self.out.view(torch.uint8).fill_(0)
        self.get_batch(batch)
        if not torch.equal(self.out.view(torch.int16), self.kv.view(torch.int16)):
            raise RuntimeError(f"batch {batch} came back with different bytes than were put")


def start_session(plan: SizePlan) -> Session:
    """The service with a host tier that holds every batch measure_host puts, plus one, and
    a disk tier for the batches measure_disk_e2e pushes down."""
    import torch

    host_pages = (HOST_SPARE_BATCHES + 2 * plan.rounds * PUT_REPS) * plan.num_pages
    disk_pages = (E2E_PUTS + 2) * plan.num_pages
    client = _start_service(_service_config(plan, host_pages, disk_pages, "service"))
    pool = torch.from_numpy(peers.page_pool(plan.page_bytes, plan.num_pages))
    pages = pool.view(torch.bfloat16).view(plan.num_pages, *SPEC.page_shape(plan.page_tokens))
    kv = pages.permute(1, 2, 3, 0, 4, 5).reshape(SPEC.page_shape(plan.batch_tokens)).clone()
    out = torch.empty_like(kv)
    out.view(torch.uint8).fill_(0xA5)
    return Session(plan, client, kv, out)


def _copy_floors_s(session: Session) -> tuple[float, float]:
    """Median seconds of the get's copies alone (page tensors -> `out` slices), no Ray:
    with torch's copy_ (what the client runs) and with numpy's copyto (single-threaded)."""
    import torch

    plan, kv, out = session.plan, session.kv, session.out
    slices = [slice(p * plan.page_tokens, (p + 1) * plan.page_tokens)
              for p in range(plan.num_pages)]
    pages = [kv[:, :, :, s].contiguous() for s in slices]
    out_np = out.view(torch.int16).numpy()
    pages_np = [page.view(torch.int16).numpy() for page in pages]

    def torch_copies() -> None:
        for s, page in zip(slices, pages, strict=True):
            out[:, :, :, s].copy_(page)

    def numpy_copies() -> None:
        for s, page in zip(slices, pages_np, strict=True):
            np.copyto(out_np[:, :, :, s], page)

    torch_copies()
    numpy_copies()
    return _median_s(torch_copies, GET_REPS), _median_s(numpy_copies, GET_REPS)


@contextmanager
def _torch_threads(num_threads: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_host(session: Session) -> dict[str, list[float]]:
    """Per round: memcpy GB/s, then raykv's median get and put GB/s, the get's phases, and
    get and put again with torch held to one thread (the client's copies use torch)."""
    plan, client = session.plan, session.client
    session.put_batch()
    session.check_batch(0)
    session.put_batch()  # warm-up
    tokens = _tokens(plan, 0)
    batch_bytes = plan.num_pages * plan.page_bytes
    gbps = lambda run, reps: batch_bytes / _median_s(run, reps) / 1e9  # noqa: E731
    rounds: dict[str, list[float]] = {name: [] for name in (
        "memcpy", "get", "put", "lookup_ms", "get_ms", "copy_floor_ms", "copy_numpy_ms",
        "get_1thread", "put_1thread")}
    for _ in range(plan.rounds):
        rounds["memcpy"].append(peers.memcpy_gbps(plan.page_bytes, plan.num_pages))
        get_s = _median_s(lambda: session.get_batch(0), GET_REPS)
        rounds["get"].append(batch_bytes / get_s / 1e9)
        rounds["get_ms"].append(get_s * 1e3)
        rounds["put"].append(gbps(session.put_batch, PUT_REPS))
        rounds["lookup_ms"].append(_median_s(lambda: client.lookup(tokens), GET_REPS) * 1e3)
        floors_s = _copy_floors_s(session)
        rounds["copy_floor_ms"].append(floors_s[0] * 1e3)
        rounds["copy_numpy_ms"].append(floors_s[1] * 1e3)
        with _torch_threads(1):
            rounds["get_1thread"].append(gbps(lambda: session.get_batch(0), GET_REPS))
            rounds["put_1thread"].append(gbps(session.put_batch, PUT_REPS))
    session.check_batch(0)
    return rounds


def measure_disk_e2e(session: Session) -> dict:
    """After measure_host, E2E_PUTS more batches: the first fills the host tier's spare
    batch, each later one demotes the least recently used batch (1, 2, ...) to disk. Then
    gets of batches on disk: each reads one up and demotes another."""
    plan = session.plan
    batch_bytes = plan.num_pages * plan.page_bytes
    put_times_s = [_median_s(session.put_batch, 1) for _ in range(E2E_PUTS)]
    on_disk = session.client.stats()["node"]["pages"]["disk"]
    if on_disk < (E2E_PUTS - 1) * plan.num_pages:
        raise RuntimeError(f"only {on_disk} pages went to disk; the host tier did not fill")
    session.check_batch(1)  # untimed, and byte-exact from disk
    get_times_s = [_median_s(lambda b=batch: session.get_batch(b), 1)
                   for batch in range(2, 2 + E2E_GETS)]
    return {"put": batch_bytes / statistics.median(put_times_s[1:]) / 1e9,
            "get": batch_bytes / statistics.median(get_times_s) / 1e9,
            "pages_on_disk_before_gets": on_disk}


# ---- the disk tier itself and fio ----------------------------------------------------------


def _arena_payloads(plan: SizePlan) -> list[np.ndarray]:
    from cluster.tiers.aligned import aligned_empty

    pool = peers.page_pool(plan.page_bytes, plan.num_pages)
    payloads = []
    for page in pool:
        buffer = aligned_empty(plan.page_bytes)
        buffer[:] = page
        payloads.append(buffer)
    return payloads


class ArenaBench:
    """Batches through a DiskArena for at least ARENA_MIN_S (fio runs FIO_RUNTIME_S):
    writes at random slots, then reads of what was written; GB/s = bytes / time."""

    def __init__(self, arena, plan: SizePlan, payloads: list[np.ndarray]) -> None:
        from cluster.tiers.aligned import aligned_empty

        self.arena, self.plan, self.payloads = arena, plan, payloads
        self.keys = [i.to_bytes(16, "little") for i in range(plan.num_pages)]
        self.outs = [aligned_empty(plan.page_bytes) for _ in range(plan.num_pages)]
        for out in self.outs:
            out.fill(0xA5)
        self.rng = np.random.default_rng(0)
        self.written: list[list[int]] = []
        self.batch_bytes = plan.num_pages * plan.page_bytes

    def _timed_batches(self, run_batch: Callable[[int], object]) -> float:
        """run_batch(i) for i = 0, 1, ... until ARENA_MIN_S and DISK_REPS batches have passed
        (batch 0 is an untimed warm-up); returns GB/s."""
        run_batch(0)
        elapsed_s, count = 0.0, 0
        while elapsed_s < ARENA_MIN_S or count < DISK_REPS:
            count += 1
            start_s = time.perf_counter()
            run_batch(count)
            elapsed_s += time.perf_counter() - start_s
        return count * self.batch_bytes / elapsed_s / 1e9

    def write_gbps(self) -> float:
        def write(_: int) -> None:
            slots = self.rng.choice(self.arena.num_slots, self.plan.num_pages,
                                    replace=False).tolist()
            self.arena.write_pages([(s, k, 0, p) for s, k, p in
                                    zip(slots, self.keys, self.payloads, strict=True)])
            self.written.append(slots)

        self.written = []
        return self._timed_batches(write)

    def read_gbps(self) -> float:
        """Reads the written batches round robin; checks every page of the last one."""
        metas: list = []

        def read(index: int) -> None:
            metas[:] = self.arena.read_pages(self.written[index % len(self.written)], self.outs)

        gbps = self._timed_batches(read)
        for meta, out in zip(metas, self.outs, strict=True):
            if meta is None or not np.array_equal(
                    out, self.payloads[int.from_bytes(meta.key, "little")]):
                raise RuntimeError("disk tier read back a missing or different page")
        return gbps


def measure_disk(plan: SizePlan) -> dict[str, list[float]]:
    """Per round: fio write, the disk arena's write, fio read, the arena's read (plan.disk_dir)."""
    from cluster.tiers.disk import DiskArena

    threads = CacheConfig().disk_threads
    fio_bytes = DISK_FILE_BYTES // plan.page_bytes * plan.page_bytes
    fio = lambda rw: peers.fio_gbps(plan.disk_dir, rw, plan.page_bytes, threads, fio_bytes)  # noqa: E731
    arena_dir = os.path.join(plan.disk_dir, "arena")
    rounds: dict[str, list[float]] = {n: [] for n in ("fio_write", "arena_write", "fio_read",
                                                      "arena_read")}
    with DiskArena(arena_dir, DISK_FILE_BYTES, plan.page_bytes, threads) as arena:
        if not arena.direct_io:
            raise RuntimeError(f"O_DIRECT does not work in {plan.disk_dir}")
        bench = ArenaBench(arena, plan, _arena_payloads(plan))
        for _ in range(plan.disk_rounds):
            rounds["fio_write"].append(fio("write"))
            rounds["arena_write"].append(bench.write_gbps())
            rounds["fio_read"].append(fio("read"))
            rounds["arena_read"].append(bench.read_gbps())
    shutil.rmtree(arena_dir, ignore_errors=True)
    return rounds


def measure_peers(plan: SizePlan, redis_url: str) -> dict[str, float]:
    redis_figures = peers.redis_gbps(redis_url, plan.page_bytes, plan.num_pages)
    local = peers.ray_gbps(plan.page_bytes, plan.num_pages)
    remote = peers.ray_gbps_remote(plan.page_bytes, plan.num_pages)
    return {"redis_set": redis_figures["set"], "redis_get": redis_figures["get"],
            "ray_put": local["put"], "ray_get": local["get"],
            "ray_remote_put": remote["put"], "ray_remote_get": remote["get"]}


# ---- one size, ratios, report --------------------------------------------------------------


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def measure_size(plan: SizePlan, redis_url: str, step: Callable[[str], None]) -> dict:
    step("host put/get vs memcpy")
    session = start_session(plan)
    host = measure_host(session)
    step("disk end to end")
    e2e = measure_disk_e2e(session)
    del session
    _stop_service()
    step("fio and disk tier")
    disk = measure_disk(plan)
    step("redis and ray")
    peer = measure_peers(plan, redis_url)
    median = statistics.median
    raw = {"page_tokens": plan.page_tokens, "pages_per_batch": plan.num_pages,
           **{name: median(values) for name, values in host.items()},
           **{name: median(values) for name, values in disk.items()},
           "disk_threads": CacheConfig().disk_threads, "disk_rounds": plan.disk_rounds,
           "disk_e2e_put": e2e["put"], "disk_e2e_get": e2e["get"],
           "disk_e2e_pages_on_disk": e2e["pages_on_disk_before_gets"], **peer,
           "rounds": {**host, **disk}}
    raw["host_get"], raw["host_put"] = raw.pop("get"), raw.pop("put")
    raw["ratios"] = {
        "host_get_vs_memcpy": _median_ratio(host["get"], host["memcpy"]),
        "host_put_vs_memcpy": _median_ratio(host["put"], host["memcpy"]),
        "host_get_vs_memcpy_1thread": _median_ratio(host["get_1thread"], host["memcpy"]),
        "host_put_vs_memcpy_1thread": _median_ratio(host["put_1thread"], host["memcpy"]),
        "disk_read_vs_raw": _median_ratio(disk["arena_read"], disk["fio_read"]),
        "disk_write_vs_raw": _median_ratio(disk["arena_write"], disk["fio_write"]),
        "host_get_vs_redis": raw["host_get"] / peer["redis_get"],
        "host_get_vs_ray": raw["host_get"] / peer["ray_remote_get"],
        "host_get_vs_ray_local": raw["host_get"] / peer["ray_get"],
        "disk_e2e_get_vs_raw_read": e2e["get"] / raw["fio_read"],
        "disk_e2e_put_vs_raw_write": e2e["put"] / raw["fio_write"],
    }
    return raw


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def summarise(per_size: dict[str, dict]) -> tuple[dict, dict]:
    """(ratios at RATIO_PAGE_MIB, or the geometric mean when it was not run; geomean ratios)."""
    names = list(next(iter(per_size.values()))["ratios"])
    geomean = {n: _geomean([s["ratios"][n] for s in per_size.values()]) for n in names}
    main = per_size.get(f"{RATIO_PAGE_MIB}MiB")
    return (dict(main["ratios"]) if main else dict(geomean)), geomean


ROWS = [("memcpy", "memcpy (limit)"), ("host_get", "raykv host get"),
        ("host_put", "raykv host put"), ("get_1thread", "raykv host get, torch 1 thread"),
        ("put_1thread", "raykv host put, torch 1 thread"), ("fio_read", "fio O_DIRECT randread"),
        ("arena_read", "raykv disk tier read"), ("fio_write", "fio O_DIRECT randwrite"),
        ("arena_write", "raykv disk tier write"), ("disk_e2e_get", "raykv get from disk (e2e)"),
        ("disk_e2e_put", "raykv put + demote (e2e)"), ("redis_get", "redis GET"),
        ("redis_set", "redis SET"), ("ray_get", "ray.get + copy (same proc)"),
        ("ray_remote_get", "ray.get + copy (other worker)"), ("ray_put", "ray.put")]


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    sizes = list(result["per_size"])
    table = Table(title="raykv tiers vs limits and peers (GB/s, 1e9 B/s; medians)")
    table.add_column("contender")
    for size in sizes:
        table.add_column(f"{size} page", justify="right")
    for key, label in ROWS:
        table.add_row(label, *(f"{result['per_size'][s][key]:.2f}" for s in sizes))
    for key, label in PHASE_ROWS:
        table.add_row(label, *(f"{result['per_size'][s][key]:.2f}" for s in sizes))
    ratios = Table(title=f"ratios ({result['ratio_basis']})")
    for column in ("ratio", "value", "goal", "met"):
        ratios.add_column(column)
    for name, value in result["ratios"].items():
        goal = result["goals"].get(name)
        met = result["met"].get(name)
        ratios.add_row(name, f"{value:.3f}", f">= {goal['min']}" if goal else "",
                       "" if met is None else ("[green]yes[/]" if met else "[red]NO[/]"))
    console = Console()
    console.print(table)
    console.print(ratios)


PHASE_ROWS = [("get_ms", "host get of one batch (ms)"),
              ("lookup_ms", "  of which keys + directory RPC (ms)"),
              ("copy_floor_ms", "  copies alone, torch copy_, no Ray (ms)"),
              ("copy_numpy_ms", "  copies alone, numpy copyto (ms)")]

NOTES = [
    f"ratios are taken at the {RATIO_PAGE_MIB} MiB page size (ratios_geomean: the geometric "
    "mean over the page sizes run)",
    "host_get/put_vs_memcpy: median over rounds of (raykv GB/s / peers.memcpy_gbps GB/s), "
    "memcpy timed right before raykv in each round; a get is one client.get(tokens, out=out) "
    "of a whole batch into a touched tensor, timed in this client process (keys, directory "
    "RPC, node acquire RPC, one copy per page out of /dev/shm); a put is one client.put of "
    "fresh pages (reserve RPC, copies, commit RPC, which flushes to the directory)",
    "get phases: lookup_ms = client.lookup (keys + directory RPC); copy_floor_ms = the same "
    "page copies into out from private tensors with torch copy_ (as the client does), "
    "without Ray; get_ms - lookup_ms - copy_floor_ms ~ the node acquire RPC and the rest; "
    "copy_numpy_ms = those copies with numpy copyto (single-threaded), for comparison",
    "*_1thread: the same get / put with torch.set_num_threads(1) in this client process "
    "(informational, no goal): the client's page copies are torch copy_, which use torch's "
    "intra-op (OpenMP) threads; on a busy 2-core node those threads wait on each other",
    "disk_read/write_vs_raw: median over disk rounds of DiskArena.read_pages/write_pages "
    "GB/s (the tier's own I/O with checksums; one batch per call at random slots, batches "
    "for >= ARENA_MIN_S, bytes / time) over fio randread/randwrite GB/s (O_DIRECT, psync, "
    "bs = page, numjobs = disk_threads, FIO_RUNTIME_S), both on files in /tmp, interleaved",
    "disk_e2e_*: through the service once its host tier is full, reported separately (no "
    "goal): each put demotes the least recently used batch to disk; each get reads a batch "
    "up from disk and demotes another, so it moves twice the bytes it returns",
    "host_get_vs_ray: vs ray_gbps_remote's get (another worker on this node ray.gets the "
    "driver's objects and copies them out); host_get_vs_ray_local: vs the in-process get",
    f"kv geometry: {SPEC.name} page shape {SPEC.page_shape(1)} per token, bf16, 128 KiB "
    "per token; the machine is shared, see machine.loadavg_*",
]


class Steps:
    """Moves the progress bar on at each phase of a page size, and times the phases."""

    def __init__(self, progress, task) -> None:
        self.progress, self.task = progress, task
        self.page_mib, self.phase, self.since_s = 0, "", 0.0
        self.phase_s: dict[str, float] = {}

    def begin(self, page_mib: int) -> None:
        self.page_mib, self.phase, self.since_s, self.phase_s = page_mib, "", 0.0, {}

    def __call__(self, phase: str) -> None:
        self._lap()
        self.phase, self.since_s = phase, time.perf_counter()
        self.progress.update(self.task, description=f"{self.page_mib} MiB: {phase}", advance=1)

    def _lap(self) -> None:
        if self.phase:
            self.phase_s[self.phase] = time.perf_counter() - self.since_s

    def end(self) -> dict[str, float]:
        self._lap()
        self.phase = ""
        return self.phase_s


def _machine() -> dict:
    import torch

    return {**machine_info(), "torch_threads": torch.get_num_threads(),
            "loadavg_start": list(os.getloadavg())}


def run(json_path: str | None, quick: bool) -> dict:
    import json

    import ray
    from rich.progress import Progress

    from cluster.redis_server import RedisServer

    page_mibs = QUICK_PAGE_MIB if quick else PAGE_MIB
    machine = _machine()
    per_size: dict[str, dict] = {}
    started_ray = _ensure_ray()
    disk_root = tempfile.mkdtemp(prefix="raykv-bench-tiers-", dir="/tmp")
    try:
        with RedisServer() as redis_server, Progress() as progress:
            steps = Steps(progress, progress.add_task("tiers", total=4 * len(page_mibs)))
            for page_mib in page_mibs:
                plan = plan_for(page_mib, quick, disk_root)

                steps.begin(page_mib)
                per_size[f"{page_mib}MiB"] = measure_size(plan, redis_server.url, steps)
                per_size[f"{page_mib}MiB"]["phase_s"] = steps.end()
    finally:
        _stop_service()
        shutil.rmtree(disk_root, ignore_errors=True)
        if started_ray:
            ray.shutdown()
    machine["loadavg_end"] = list(os.getloadavg())
    ratios, geomean = summarise(per_size)
    basis = f"{RATIO_PAGE_MIB}MiB" in per_size
    result = {"benchmark": "tiers", "unit": "GB/s (1e9 B/s)",
              "ratio_basis": f"{RATIO_PAGE_MIB} MiB pages" if basis else "geometric mean",
              "config": {"page_mib": list(page_mibs), "batch_bytes": plan.num_pages
                         * plan.page_bytes, "rounds": plan.rounds, "get_reps": GET_REPS,
                         "put_reps": PUT_REPS, "disk_reps": DISK_REPS,
                         "arena_min_s": ARENA_MIN_S, "fio_runtime_s": peers.FIO_RUNTIME_S,
                         "disk_file_bytes": DISK_FILE_BYTES, "disk_dir": "/tmp",
                         "top_tier": "host (device_bytes=0)", "quick": quick},
              "machine": machine, "per_size": per_size, "ratios": ratios,
              "ratios_geomean": geomean, "goals": GOALS, "met": goals_met(ratios, GOALS),
              "notes": NOTES + (["quick run: fewer sizes, smaller batches, fewer rounds"]
                                if quick else [])}
    print_report(result)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(result, file, indent=2)
    return result
