"""`raykv bench tiers`: raykv's host and disk tiers next to the machine's limits and peers.

For each page size (1, 4, 16 MiB), in one run, the same batch of pages (BATCH_BYTES) moves:

    memcpy            np.copyto page by page, touched buffers       (limit of a host get/put)
    raykv host get    client.get(tokens, out=out) from this process, of a batch it read before:
                      keys; np.copyto of each page from the slot the client noted into `out`;
                      each slot's generation checked after (no call to the node on the path)
    raykv leased get  the same with the client's notes dropped first: the node's acquire and
                      the directory match sent together, the copies, release (not awaited)
    raykv host put    client.put(tokens, kv) of fresh pages: keys, reserve RPC, np.copyto of
                      each page into its slot, commit RPC (the directory is told after it)
    fio read/write    O_DIRECT psync, block = page, numjobs = disk_threads     (disk limit)
    disk tier         DiskArena.write_pages / read_pages, same page, batch and threads, into
                      4096-aligned buffers: what demotion and promotion run (see disk.py)
    disk end to end   the same service once its host tier is full: a put demotes a batch to
                      disk, a get reads a batch up from disk (and demotes another)
    redis             pipelined SET / GET of the pages, GET copied out     (peer, loopback TCP)
    ray               ray.put / ray.get + copy, in-process and from another worker (peer)

Every contender's bytes end in a buffer the caller owns and has already touched. Host figures
are taken in ROUNDS, each round timing memcpy right before raykv, and a ratio is the median of
the per-round ratios, so a noisy neighbour on this shared machine slows both sides alike.

Phases: the same get and put taken apart, each step timed on its own through the same calls
the client makes (keys, acquire, match, both together, copies; reserve, copies, commit), so a
missed goal shows which step holds the time. All figures are GB/s (1e9 B/s) of page bytes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import ray

from cluster.core.config import CacheConfig
from cluster.core.copies import copy_page
from cluster.core.kvcheck import page_slices
from cluster.tools.bench import common, disk, peers

MiB = common.MiB
PAGE_MIB = (1, 4, 16)
QUICK_PAGE_MIB = (1, 4)
RATIO_PAGE_MIB = 4
BATCH_BYTES = 64 * MiB
QUICK_BATCH_BYTES = 32 * MiB
ROUNDS = 3
QUICK_ROUNDS = 2
GET_REPS = 9  # per round
PUT_REPS = 3  # per round, and as many taken apart; each needs fresh slots in the host tier
DISK_ROUNDS = 2  # at RATIO_PAGE_MIB (fio takes FIO_RUNTIME_S a run); one at other sizes
HOST_SPARE_BATCHES = 3  # host tier: batch 0, the warm-up put, one spare, then the timed puts
E2E_PUTS = 7  # disk end to end: puts after measure_host (all but the first demote a batch)
E2E_GETS = 4  # timed gets of batches on disk (after one untimed, checked)
TOKEN_STRIDE = 1 << 24  # batch b's tokens start at b * TOKEN_STRIDE
OBJECT_STORE_BYTES = 768 * MiB
DISK_HEADER_BYTES = 4096
SPEC = common.LLAMA_8B_KV  # pages of 8, 32 and 128 tokens
GOALS = {
    "host_get_vs_memcpy": {"min": 0.9},
    "host_put_vs_memcpy": {"min": 0.8},
    "disk_read_vs_raw": {"min": 0.85},
    "disk_write_vs_raw": {"min": 0.85},
    "durable_write_vs_raw": {"min": 0.85},
    "host_get_vs_redis": {"min": 10.0},
    "host_get_vs_ray": {"min": 1.0},
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
    def batch_bytes(self) -> int:
        return self.num_pages * self.page_bytes


def plan_for(page_mib: int, quick: bool, disk_dir: str) -> SizePlan:
    page_bytes = page_mib * MiB
    page_tokens = page_bytes // SPEC.bytes_per_token
    assert SPEC.page_bytes(page_tokens) == page_bytes, f"{page_mib} MiB is not whole tokens"
    batch_bytes = QUICK_BATCH_BYTES if quick else BATCH_BYTES
    disk_rounds = DISK_ROUNDS if page_mib == RATIO_PAGE_MIB and not quick else 1
    return SizePlan(page_bytes, page_tokens, max(1, batch_bytes // page_bytes),
                    QUICK_ROUNDS if quick else ROUNDS, disk_rounds, disk_dir)


# ---- the service ---------------------------------------------------------------------------


def _service_config(plan: SizePlan) -> CacheConfig:
    """device_bytes=0: the host tier is the top tier. It holds every batch measure_host puts
    plus one spare; the disk tier holds what measure_disk_e2e pushes down."""
    host_batches = HOST_SPARE_BATCHES + 2 * plan.rounds * PUT_REPS
    disk_pages = (E2E_PUTS + 2) * plan.num_pages
    return CacheConfig(page_tokens=plan.page_tokens, device_bytes=0,
                       host_bytes=host_batches * plan.batch_bytes,  # pages are 4096-aligned
                       disk_bytes=disk_pages * (DISK_HEADER_BYTES + plan.page_bytes),
                       eviction="lru", disk_codec="none",
                       disk_dir=os.path.join(plan.disk_dir, f"service-{plan.page_bytes // MiB}"))


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

    def fresh_tokens(self) -> np.ndarray:
        self.num_batches += 1
        return _tokens(self.plan, self.num_batches - 1)

    def put_batch(self) -> None:
        """Put the next fresh batch; raise unless all its pages were stored."""
        stored = self.client.put(self.fresh_tokens(), self.kv)
        if stored != self.plan.batch_tokens:
            raise RuntimeError(f"put stored {stored} of {self.plan.batch_tokens} tokens")

    def get_batch(self, batch: int) -> None:
        num_tokens, _ = self.client.get(_tokens(self.plan, batch), out=self.out)
        if num_tokens != self.plan.batch_tokens:
            raise RuntimeError(f"get returned {num_tokens} of {self.plan.batch_tokens} tokens")

    def get_leased(self, batch: int) -> None:
        """A get that asks the node (acquire + match): the client's slot notes dropped."""
        self.client.view.slabs.forget(self.client.keys(_tokens(self.plan, batch)))
        self.get_batch(batch)

    def check_batch(self, batch: int) -> None:
        """Get a batch into a zeroed out and compare every byte with what was put."""
        self.out.zero_()
        self.get_batch(batch)
        common.check_same(self.out, self.kv, f"batch {batch}")


def start_session(plan: SizePlan) -> Session:
    client = common.start_service(_service_config(plan), SPEC)
    kv = common.page_kv(SPEC, plan.page_tokens, plan.num_pages)
    return Session(plan, client, kv, common.touched_like(kv))


# ---- the get and the put taken apart -------------------------------------------------------


def _acquire_s(client, keys: list) -> float:
    """The local node's acquire RPC alone (its release untimed)."""
    acquire_s, (_, lease_id, _) = common.timed(
        lambda: ray.get(client.local.acquire(client.geometry, keys)))
    ray.get(client.local.release(lease_id))
    return acquire_s


def _acquire_and_match_s(client, keys: list) -> float:
    """Both RPCs sent together and both answers awaited, as fetch_prefix does."""
    def both() -> int:
        acquired = client.local.acquire(client.geometry, keys)
        _, refs = client.directory.prefix_refs(keys)
        ray.get(refs)
        return ray.get(acquired)[1]

    both_s, lease_id = common.timed(both)
    ray.get(client.local.release(lease_id))
    return both_s


def _get_copies_s(session: Session, keys: list) -> float:
    """The get's page copies alone: pinned slots -> out, as fetch_prefix's _copy_local."""
    client, out = session.client, session.out
    epoch, lease_id, slots = ray.get(client.local.acquire(client.geometry, keys))
    common.map_slabs(client, epoch)

    def copies() -> None:
        for position, (tier, slot, _) in enumerate(slots):
            copy_page(out[:, :, :, page_slices(position, client.page_tokens)],
                      client.view.slabs.page(tier, slot))

    try:
        return common.warm_median_s(copies, GET_REPS)
    finally:
        ray.get(client.local.release(lease_id))


def _copy_floor_s(session: Session) -> float:
    """The same copies into out from private contiguous pages (anonymous memory), no Ray."""
    client, out = session.client, session.out
    pages = [session.kv[:, :, :, page_slices(p, client.page_tokens)].contiguous()
             for p in range(session.plan.num_pages)]

    def copies() -> None:
        for position, page in enumerate(pages):
            copy_page(out[:, :, :, page_slices(position, client.page_tokens)], page)

    return common.warm_median_s(copies, GET_REPS)


def get_phases_s(session: Session) -> dict[str, float]:
    """Medians of GET_REPS of each step of a get of batch 0, each step timed alone."""
    client = session.client
    tokens = _tokens(session.plan, 0)
    keys = client.keys(tokens)
    median = lambda run: statistics.median(run() for _ in range(GET_REPS))  # noqa: E731
    return {"keys": common.median_s(lambda: client.keys(tokens), GET_REPS),
            "acquire": median(lambda: _acquire_s(client, keys)),
            "match": common.median_s(lambda: client.locate_keys(keys), GET_REPS),
            "acquire_and_match": median(lambda: _acquire_and_match_s(client, keys)),
            "get_copies": _get_copies_s(session, keys), "copy_floor": _copy_floor_s(session)}


def put_phases_s(session: Session) -> dict[str, float]:
    """One put of a fresh batch, done step by step as client.put does it, each step timed."""
    client, kv = session.client, session.kv
    tokens = session.fresh_tokens()
    keys_s, keys = common.timed(lambda: client.keys(tokens))
    reserve_s, (epoch, reservation_id, slots) = common.timed(
        lambda: ray.get(client.local.reserve(client.geometry, keys)))
    if len(slots) != len(keys) or None in slots:
        raise RuntimeError(f"reserve found room for {len(slots)} of {len(keys)} pages")
    common.map_slabs(client, epoch)

    def copies() -> None:
        for page, (tier, slot, _) in enumerate(slots):
            copy_page(client.view.slabs.page(tier, slot),
                      kv[:, :, :, page_slices(page, client.page_tokens)])

    copies_s, _ = common.timed(copies)
    rewrite_s, _ = common.timed(copies)  # the same slots again: their memory now touched
    commit_s, _ = common.timed(lambda: ray.get(client.local.commit(reservation_id)))
    return {"put_keys": keys_s, "reserve": reserve_s, "put_copies": copies_s,
            "put_copies_rewrite": rewrite_s, "commit": commit_s}


# ---- measurements --------------------------------------------------------------------------


def _host_round(session: Session) -> dict[str, float]:
    """memcpy, then raykv's get and put, then the same taken apart (ms)."""
    plan = session.plan
    memcpy = peers.memcpy_gbps(plan.page_bytes, plan.num_pages)
    get_s = common.median_s(lambda: session.get_batch(0), GET_REPS)
    leased_s = common.median_s(lambda: session.get_leased(0), GET_REPS)
    put_s = common.median_s(session.put_batch, PUT_REPS)
    phases = get_phases_s(session)
    put_phases = [put_phases_s(session) for _ in range(PUT_REPS)]
    phases.update({name: statistics.median(p[name] for p in put_phases)
                   for name in put_phases[0]})
    return {"memcpy": memcpy, "get": plan.batch_bytes / get_s / 1e9,
            "put": plan.batch_bytes / put_s / 1e9, "get_ms": get_s * 1e3,
            "leased_get": plan.batch_bytes / leased_s / 1e9, "leased_get_ms": leased_s * 1e3,
            "put_ms": put_s * 1e3, **{f"{name}_ms": s * 1e3 for name, s in phases.items()}}


def measure_host(session: Session) -> dict[str, list[float]]:
    """Per round: see _host_round. Batch 0 is put and checked byte for byte first and last."""
    session.put_batch()
    session.check_batch(0)
    session.put_batch()  # warm-up
    session.get_batch(0)
    rounds: dict[str, list[float]] = {}
    for _ in range(session.plan.rounds):
        for name, value in _host_round(session).items():
            rounds.setdefault(name, []).append(value)
    session.check_batch(0)
    return rounds


def measure_disk_e2e(session: Session) -> dict:
    """After measure_host, E2E_PUTS more batches: the first fills the host tier's spare
    batch, each later one demotes the least recently used batch (1, 2, ...) to disk. Then
    gets of batches on disk: each reads one up and demotes another."""
    plan = session.plan
    put_times_s = [common.timed(session.put_batch)[0] for _ in range(E2E_PUTS)]
    on_disk = session.client.stats()["node"]["pages"]["disk"]
    if on_disk < (E2E_PUTS - 1) * plan.num_pages:
        raise RuntimeError(f"only {on_disk} pages went to disk; the host tier did not fill")
    session.check_batch(1)  # untimed, and byte-exact from disk
    get_times_s = [common.timed(lambda b=batch: session.get_batch(b))[0]
                   for batch in range(2, 2 + E2E_GETS)]
    return {"disk_e2e_put": plan.batch_bytes / statistics.median(put_times_s[1:]) / 1e9,
            "disk_e2e_get": plan.batch_bytes / statistics.median(get_times_s) / 1e9,
            "disk_e2e_pages_on_disk": on_disk}


def measure_peers(plan: SizePlan, redis_url: str) -> dict[str, float]:
    redis_figures = peers.redis_gbps(redis_url, plan.page_bytes, plan.num_pages)
    local = peers.ray_gbps(plan.page_bytes, plan.num_pages)
    remote = peers.ray_gbps_remote(plan.page_bytes, plan.num_pages)
    return {"redis_set": redis_figures["set"], "redis_get": redis_figures["get"],
            "ray_put": local["put"], "ray_get": local["get"],
            "ray_remote_put": remote["put"], "ray_remote_get": remote["get"]}


def size_ratios(host: dict, disk_rounds: dict, raw: dict) -> dict[str, float]:
    ratio = common.median_ratio
    return {
        "host_get_vs_memcpy": ratio(host["get"], host["memcpy"]),
        "host_put_vs_memcpy": ratio(host["put"], host["memcpy"]),
        "disk_read_vs_raw": ratio(disk_rounds["arena_read"], disk_rounds["fio_read"]),
        "disk_write_vs_raw": ratio(disk_rounds["arena_write"], disk_rounds["fio_write"]),
        "durable_write_vs_raw": ratio(disk_rounds["arena_durable_write"],
                                      disk_rounds["fio_durable_write"]),
        "durable_write_vs_volatile": ratio(disk_rounds["arena_durable_write"],
                                           disk_rounds["arena_write"]),
        "host_get_vs_redis": raw["host_get"] / raw["redis_get"],
        "host_get_vs_ray": raw["host_get"] / raw["ray_remote_get"],
        "host_get_vs_ray_local": raw["host_get"] / raw["ray_get"],
        "disk_e2e_get_vs_raw_read": raw["disk_e2e_get"] / raw["fio_read"],
        "disk_e2e_put_vs_raw_write": raw["disk_e2e_put"] / raw["fio_write"],
    }


def measure_size(plan: SizePlan, redis_url: str, step: Callable[[str], None]) -> dict:
    step("host put/get vs memcpy")
    session = start_session(plan)
    host = measure_host(session)
    step("disk end to end")
    e2e = measure_disk_e2e(session)
    del session
    common.stop_service()
    step("fio and disk tier")
    disk_rounds = disk.measure_disk(plan.disk_dir, plan.page_bytes, plan.num_pages,
                                    plan.disk_rounds)
    step("redis and ray")
    raw = {"page_tokens": plan.page_tokens, "pages_per_batch": plan.num_pages,
           **common.medians(host), **common.medians(disk_rounds), **e2e,
           **measure_peers(plan, redis_url), "disk_threads": CacheConfig().disk_threads,
           "disk_rounds": plan.disk_rounds, "rounds": {**host, **disk_rounds}}
    raw["host_get"], raw["host_put"] = raw.pop("get"), raw.pop("put")
    raw["ratios"] = size_ratios(host, disk_rounds, raw)
    return raw


def summarise(per_size: dict[str, dict]) -> tuple[dict, dict]:
    """(ratios at RATIO_PAGE_MIB, or the geometric mean when it was not run; geomean ratios)."""
    names = list(next(iter(per_size.values()))["ratios"])
    geomean = {n: common.geomean(s["ratios"][n] for s in per_size.values()) for n in names}
    main = per_size.get(f"{RATIO_PAGE_MIB}MiB")
    return (dict(main["ratios"]) if main else dict(geomean)), geomean


# ---- report --------------------------------------------------------------------------------

GBPS_ROWS = [("memcpy", "memcpy (limit)"), ("host_get", "raykv host get"),
             ("leased_get", "raykv host get, leased (acquire + match)"),
             ("host_put", "raykv host put"), ("fio_read", "fio O_DIRECT randread"),
             ("arena_read", "raykv disk tier read"), ("fio_write", "fio O_DIRECT randwrite"),
             ("arena_write", "raykv disk tier write"),
             ("fio_durable_write", "fio O_DIRECT randwrite, --fdatasync=1"),
             ("arena_durable_write", "raykv disk tier write, durable"),
             ("disk_e2e_get", "raykv get from disk (e2e)"),
             ("disk_e2e_put", "raykv put + demote (e2e)"), ("redis_get", "redis GET + copy"),
             ("redis_set", "redis SET"), ("ray_get", "ray.get + copy (same proc)"),
             ("ray_remote_get", "ray.get + copy (other worker)"), ("ray_put", "ray.put")]
MS_ROWS = [("get_ms", "host get of one batch"), ("leased_get_ms", "leased get of one batch"),
           ("keys_ms", "  keys"),
           ("acquire_ms", "  acquire RPC alone"), ("match_ms", "  directory match alone"),
           ("acquire_and_match_ms", "  acquire + match together"),
           ("get_copies_ms", "  copies slab -> out"),
           ("copy_floor_ms", "    same copies from private pages"),
           ("put_ms", "host put of one batch"), ("put_keys_ms", "  keys"),
           ("reserve_ms", "  reserve RPC"), ("put_copies_ms", "  copies kv -> fresh slots"),
           ("put_copies_rewrite_ms", "    same copies again (touched)"),
           ("commit_ms", "  commit RPC"), ("arena_checksum_ms", "disk: checksums")]

NOTES = [
    f"ratios are taken at the {RATIO_PAGE_MIB} MiB page size (ratios_geomean: the geometric "
    "mean over the page sizes run)",
    "host_get/put_vs_memcpy: median over rounds of (raykv GB/s / peers.memcpy_gbps GB/s), "
    "memcpy timed right before raykv in each round; a get is one client.get(tokens, out=out) "
    "of a whole batch into a touched tensor, timed in this client process, of a batch the "
    "client read before (optimistic: copies from the slots it noted, generations checked "
    "after, no call to the node); leased_get: the same get with those notes dropped first "
    "(acquire + match, copies, release); a put is one client.put of fresh pages (reserve "
    "RPC, copies, commit RPC; the node tells the directory after answering)",
    "phases (*_ms, medians): each step of the get of batch 0 and of fresh puts, timed alone "
    "through the calls the client makes: keys; the node's acquire RPC; the directory match; "
    "both sent together (what the get waits for); np.copyto of the pages slab -> out "
    "(copy_floor: the same copies from private contiguous pages, no Ray); reserve RPC; "
    "np.copyto kv -> the reserved (fresh) slots, then the same copies again into the same "
    "slots (put_copies_rewrite: their memory now touched); commit RPC",
    "arena_checksum_ms: xxh3_64 of one batch's pages in one thread (the disk tier checksums "
    "every page it writes and reads)",
    "disk_read/write_vs_raw: median over disk rounds of DiskArena.read_pages/write_pages "
    "GB/s (the tier's own I/O with checksums; one batch per call at random slots, batches "
    "for >= ARENA_MIN_S, bytes / time) over fio randread/randwrite GB/s (O_DIRECT, psync, "
    "bs = page, numjobs = disk_threads, FIO_RUNTIME_S), both on files in /tmp, interleaved",
    "durable_write_vs_raw: median over disk rounds of DiskArena.write_pages GB/s in the "
    "durable mode (one fdatasync of the batch's slab files before it returns, as the "
    "service's default does) over fio randwrite --fdatasync=1 GB/s (an fdatasync after every "
    "write of every job; same bs, numjobs, file size and runtime), interleaved; "
    "durable_write_vs_volatile (no goal): the durable mode's write over the volatile one's "
    "(the cost of durability), same rounds",
    "disk_e2e_*: through the service once its host tier is full, reported separately (no "
    "goal): each put demotes the least recently used batch to disk; each get reads a batch "
    "up from disk and demotes another, so it moves twice the bytes it returns",
    "host_get_vs_redis: vs pipelined GETs copied into a touched buffer (hiredis, loopback); "
    "host_get_vs_ray: vs ray_gbps_remote's get (another worker on this node ray.gets the "
    "driver's objects and copies them out); host_get_vs_ray_local: vs the in-process get",
    f"kv geometry: {SPEC.name} page shape {SPEC.page_shape(1)} per token, bf16, 128 KiB "
    "per token; the machine is shared, see machine.loadavg_*",
]


def print_report(result: dict) -> None:
    sizes = list(result["per_size"])
    header = ["contender", *(f"{size} page" for size in sizes)]
    cells = lambda key: [f"{result['per_size'][s][key]:.2f}" for s in sizes]  # noqa: E731
    common.print_tables([
        common.table("raykv tiers vs limits and peers (GB/s, 1e9 B/s; medians)", header,
                     ([label, *cells(key)] for key, label in GBPS_ROWS)),
        common.table("where a host get and put spend their time (ms, medians)", header,
                     ([label, *cells(key)] for key, label in MS_ROWS))])


def _config(page_mibs: tuple[int, ...], plan: SizePlan, quick: bool) -> dict:
    return {"page_mib": list(page_mibs), "batch_bytes": plan.batch_bytes,
            "rounds": plan.rounds, "get_reps": GET_REPS, "put_reps": PUT_REPS,
            "disk_reps": disk.DISK_REPS, "arena_min_s": disk.ARENA_MIN_S,
            "fio_runtime_s": peers.FIO_RUNTIME_S, "disk_file_bytes": disk.DISK_FILE_BYTES,
            "disk_dir": "/tmp", "top_tier": "host (device_bytes=0)", "quick": quick}


def measure_sizes(page_mibs: tuple[int, ...], quick: bool, disk_root: str) -> dict[str, dict]:
    from rich.progress import Progress

    from cluster.tools.redis_server import RedisServer

    per_size: dict[str, dict] = {}
    with RedisServer() as redis_server, Progress() as progress:
        steps = common.Steps(progress, "tiers", 4 * len(page_mibs))
        for page_mib in page_mibs:
            name = f"{page_mib}MiB"
            per_size[name] = measure_size(plan_for(page_mib, quick, disk_root),
                                          redis_server.url, steps)
            per_size[name]["phase_s"] = steps.laps()
    return per_size


def run(json_path: str | None, quick: bool) -> dict:
    page_mibs = QUICK_PAGE_MIB if quick else PAGE_MIB
    machine = common.machine_info()
    started_ray = common.ensure_local_ray(OBJECT_STORE_BYTES)
    disk_root = tempfile.mkdtemp(prefix="raykv-bench-tiers-", dir="/tmp")
    try:
        per_size = measure_sizes(page_mibs, quick, disk_root)
    finally:
        common.stop_service()
        shutil.rmtree(disk_root, ignore_errors=True)
        if started_ray:
            ray.shutdown()
    ratios, geomean = summarise(per_size)
    basis = f"{RATIO_PAGE_MIB}MiB" in per_size
    result = {"benchmark": "tiers", "unit": "GB/s (1e9 B/s), ms",
              "ratio_basis": f"{RATIO_PAGE_MIB} MiB pages" if basis else "geometric mean",
              "config": _config(page_mibs, plan_for(page_mibs[-1], quick, "/tmp"), quick),
              "machine": machine, "per_size": per_size, "ratios": ratios,
              "ratios_geomean": geomean, "goals": GOALS,
              "notes": NOTES + (["quick run: fewer sizes, smaller batches, fewer rounds"]
                                if quick else [])}
    print_report(result)
    return common.finish(result, json_path)
