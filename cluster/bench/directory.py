"""`raykv bench directory`: longest-prefix lookup of a 128K-token prompt vs its floors and peers.

A 128K-token prompt (512 pages of 256 tokens, 16 KiB each) is put through the client for real,
then, from the driver on a private local Ray, side by side in one interleaved loop (REPS times;
each repetition times every contender once, in a rotating order, so that a noisy neighbour slows
them all alike):

    ping             shard.ping: a no-op call to a directory shard actor      (the RPC floor)
    ping all         ray.get of a ping to every shard at once (= ping with 1 shard)
    match            client.directory.match(keys): keys precomputed, one RPC per shard in
                     parallel, merged                                 (the directory's part)
    lookup e2e       client.lookup(tokens): page keys (blake3 chain) + match
    redis EXISTS     one pipelined EXISTS per key of the same 512 keys, SET beforehand
                     (redis-py + hiredis, loopback TCP)                              (peer)

for 1 and 2 directory shards (the service stopped and started in between). Then throughput:
match calls in a closed loop from 1 and 2 client threads for THROUGHPUT_S, in page-keys/s,
in total and per shard. The machine has 2 cores shared by the driver, the shards, the node
actor and Ray's own processes, so shard scaling here shows overhead, not capacity.

Breakdown (no Ray): DirectoryIndex.match over the same 512 keys in-process, and pickling the
keys and the answer, which is what a match adds on top of the ping floor.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import ray

from cluster.bench.hashing import goals_met, machine_info
from cluster.config import CacheConfig
from cluster.keys import KEY_BYTES
from cluster.spec import ModelSpec

MiB = 1 << 20
PAGE_TOKENS = 256
NUM_PAGES = 512
NUM_TOKENS = NUM_PAGES * PAGE_TOKENS  # 128K tokens
SHARD_COUNTS = (1, 2)
CLIENT_THREADS = (1, 2)
REPS = 300
QUICK_REPS = 50
WARMUP_REPS = 20
THROUGHPUT_S = 2.0
QUICK_THROUGHPUT_S = 1.0
THROUGHPUT_WINDOWS = 5  # per thread count, alternating
INDEX_REPS = 50
HOST_BYTES = 32 * MiB  # the 8 MiB prompt and room to spare
OBJECT_STORE_BYTES = 128 * MiB
VOCAB = 128_256
# 2 x 1 layer x 1 kv head x 16 x fp16 = 64 B per token: a 256-token page is 16 KiB.
SPEC = ModelSpec("bench-dir", 1, 1, 16, "float16")
GOALS = {
    "lookup_p50_vs_noop_rpc": {"max": 1.5},
    "directory_vs_redis": {"min": 2.0},
}


@ray.remote(num_cpus=0)
class CompactShard:
    """Not raykv: a what-if shard for the report. Keys arrive as one bytes blob, the index maps
    a key to one shared location tuple, and the answer is run-length encoded
    [(node_id, tier, num_pages)], which is what a prefix held on one node and tier becomes."""

    def __init__(self, keys_blob: bytes, node_id: str, tier: int) -> None:
        location = (node_id, tier)
        self.index = {keys_blob[i:i + KEY_BYTES]: location
                      for i in range(0, len(keys_blob), KEY_BYTES)}

    async def match(self, keys_blob: bytes) -> list[tuple[str, int, int]]:
        runs: list[list] = []
        for offset in range(0, len(keys_blob), KEY_BYTES):
            location = self.index.get(keys_blob[offset:offset + KEY_BYTES])
            if location is None:
                break
            if runs and runs[-1][0] is location:
                runs[-1][1] += 1
            else:
                runs.append([location, 1])
        return [(node, tier, count) for (node, tier), count in runs]

    async def ping(self) -> int:
        return 0


# ---- Ray and the service (also used by cluster.bench.remote) -------------------------------


def ensure_local_ray() -> bool:
    """Start a private local Ray (2 CPUs, one kv node) unless one is up; True if started here."""
    if ray.is_initialized():
        return False
    ray.init(address="local", num_cpus=2, resources={CacheConfig().node_resource: 1},
             include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             logging_level=logging.WARNING, log_to_driver=False)
    return True


def stop_service(max_shards: int = 8, timeout_s: float = 30.0) -> None:
    """stop() (node actors release their /dev/shm slabs), then wait until the service's named
    actors are gone, so that the next start() creates fresh ones."""
    from actors.handles import CONTROLLER_NAME, DIRECTORY_NAME, NODE_NAME
    from cluster import stop

    stop()
    node_ids = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    names = ([DIRECTORY_NAME.format(shard=i) for i in range(max_shards)] + [CONTROLLER_NAME]
             + [NODE_NAME.format(node_id=n) for n in node_ids])
    namespace = CacheConfig().ray_namespace
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        alive = 0
        for name in names:
            try:
                ray.get_actor(name, namespace=namespace)
                alive += 1
            except ValueError:
                pass
        if not alive:
            return
        time.sleep(0.1)
    raise RuntimeError(f"raykv actors still alive {timeout_s:.0f} s after stop()")


def percentile_ms(times_s: list[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation) of times_s, in ms."""
    return float(np.percentile(np.asarray(times_s), q)) * 1e3


# ---- one shard count -----------------------------------------------------------------------


def prompt_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, NUM_TOKENS, dtype=np.int64)


def prompt_kv():
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(SPEC.page_shape(NUM_TOKENS), generator=generator).to(torch.float16)


def _service_config(num_shards: int, disk_dir: str) -> CacheConfig:
    return CacheConfig(page_tokens=PAGE_TOKENS, num_directory_shards=num_shards,
                       host_bytes=HOST_BYTES, device_bytes=0, disk_bytes=0,
                       disk_dir=os.path.join(disk_dir, f"shards-{num_shards}"))


def _start_client(num_shards: int, disk_dir: str, tokens: np.ndarray, kv):
    from cluster import connect, start

    stop_service()
    start(_service_config(num_shards, disk_dir))
    client = connect(SPEC)
    stored = client.put(tokens, kv)
    if stored != NUM_TOKENS:
        raise RuntimeError(f"put stored {stored} of {NUM_TOKENS} tokens")
    found = client.lookup(tokens)
    if found != NUM_TOKENS:
        raise RuntimeError(f"lookup found {found} of {NUM_TOKENS} tokens after the put")
    return client


class RedisExists:
    """The same keys in Redis: SET once; a check is one pipeline of EXISTS, one per key."""

    def __init__(self, url: str, keys: list[bytes]) -> None:
        import redis
        import redis.utils

        if not redis.utils.HIREDIS_AVAILABLE:
            raise RuntimeError("redis-py without hiredis would understate Redis; "
                               "pip install hiredis")
        self.client = redis.Redis.from_url(url)
        self.keys = [b"raykv:bench:dir:" + key for key in keys]
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.set(key, b"1")
        pipe.execute()

    def exists(self) -> int:
        """Longest prefix of keys present, in pages (Redis has no prefix walk: check all)."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.exists(key)
        found = 0
        for present in pipe.execute():
            if not present:
                break
            found += 1
        return found

    def close(self) -> None:
        self.client.delete(*self.keys)
        self.client.close()


def _contenders(client, tokens: np.ndarray, keys: list, redis: RedisExists, compact
                ) -> dict[str, Callable[[], int | None]]:
    """name -> a call returning how many pages it found (a lookup must find them all), or
    None for a no-op."""
    first = client.directory.shards[0]
    keys_blob = b"".join(keys)

    def ping() -> None:
        ray.get(first.ping.remote())

    def ping_all() -> None:
        ray.get(client.directory.ping())

    def compact_ping() -> None:
        ray.get(compact.ping.remote())

    def compact_match() -> int:
        return sum(count for _, _, count in ray.get(compact.match.remote(keys_blob)))

    return {
        "ping": ping,
        "ping_all": ping_all,
        "match": lambda: len(client.directory.match(keys)),
        "lookup_e2e": lambda: client.lookup(tokens) // PAGE_TOKENS,
        "redis_exists": redis.exists,
        "compact_ping": compact_ping,
        "compact_match": compact_match,
    }


def measure_latency(contenders: dict[str, Callable[[], int | None]], reps: int) -> dict[str, list]:
    """Each repetition times every contender once, the order rotating per repetition."""
    names = list(contenders)
    for _ in range(WARMUP_REPS):
        for name in names:
            contenders[name]()
    times_s: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start_s = time.perf_counter()
            found = contenders[name]()
            times_s[name].append(time.perf_counter() - start_s)
            if found is not None and found != NUM_PAGES:
                raise RuntimeError(f"{name} found {found} of {NUM_PAGES} pages")
    return times_s


def measure_throughput(client, keys: list, num_threads: int, duration_s: float) -> float:
    """Page-keys matched per second by num_threads threads calling match in a closed loop."""
    calls = [0] * num_threads
    errors: list[BaseException] = []
    deadline_s = time.perf_counter() + duration_s

    def loop(slot: int) -> None:
        try:
            while time.perf_counter() < deadline_s:
                if len(client.directory.match(keys)) != NUM_PAGES:
                    raise RuntimeError("match lost pages under load")
                calls[slot] += 1
        except BaseException as error:  # noqa: BLE001 - re-raised in the driver below
            errors.append(error)

    start_s = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = time.perf_counter() - start_s
    if errors:
        raise errors[0]
    return sum(calls) * NUM_PAGES / elapsed_s


def measure_throughputs(client, keys: list, duration_s: float) -> dict[str, float]:
    """Median page-keys/s per client-thread count over THROUGHPUT_WINDOWS short windows that
    alternate between the thread counts (so load from neighbours hits each count alike)."""
    windows: dict[str, list[float]] = {str(n): [] for n in CLIENT_THREADS}
    for _ in range(THROUGHPUT_WINDOWS):
        for n in CLIENT_THREADS:
            windows[str(n)].append(measure_throughput(client, keys, n,
                                                      duration_s / THROUGHPUT_WINDOWS))
    return {n: statistics.median(values) for n, values in windows.items()}


def _pid_of(actor) -> int:
    from ray._private.state import actors

    return int(actors(actor._actor_id.hex())["Pid"])


def _cpu_ns(pids: list[int]) -> int:
    """CPU time used so far by every thread of the processes (from /proc, Linux)."""
    total_ns = 0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                    total_ns += int(file.read().split()[0])
            except (OSError, ValueError):
                pass  # a thread that exited meanwhile
    return total_ns


def measure_cpu(contenders: dict[str, Callable], pids: dict[str, list[int]],
                calls: int) -> dict[str, dict[str, float]]:
    """CPU microseconds per call in the called actor(s) and in this (client) process."""
    cpu = {}
    for name, server_pids in pids.items():
        run = contenders[name]
        client_ns, server_ns = time.process_time_ns(), _cpu_ns(server_pids)
        for _ in range(calls):
            run()
        cpu[name] = {"server_us": (_cpu_ns(server_pids) - server_ns) / calls / 1e3,
                     "client_us": (time.process_time_ns() - client_ns) / calls / 1e3}
    return cpu


def _here():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def measure_shards(num_shards: int, disk_dir: str, redis_url: str, reps: int,
                   duration_s: float) -> dict:
    tokens, kv = prompt_tokens(), prompt_kv()
    client = _start_client(num_shards, disk_dir, tokens, kv)
    keys = client.keys(tokens)
    node_id, tier = client.directory.match(keys)[0][0]
    compact = CompactShard.options(scheduling_strategy=_here()).remote(b"".join(keys),
                                                                        node_id, tier)
    redis = RedisExists(redis_url, keys)
    try:
        contenders = _contenders(client, tokens, keys, redis, compact)
        times_s = measure_latency(contenders, reps)
        shard_pids = [_pid_of(shard) for shard in client.directory.shards]
        cpu = measure_cpu(contenders, {"ping": shard_pids[:1], "match": shard_pids,
                                       "compact_ping": [_pid_of(compact)],
                                       "compact_match": [_pid_of(compact)]}, reps)
        throughput = measure_throughputs(client, keys, duration_s)
    finally:
        redis.close()
        ray.kill(compact)
    figures: dict = {"num_shards": num_shards}
    for name, values in times_s.items():
        figures[f"{name}_p50_ms"] = percentile_ms(values, 50)
        figures[f"{name}_p99_ms"] = percentile_ms(values, 99)
        figures[f"{name}_mean_ms"] = statistics.fmean(values) * 1e3
    figures["match_keys_per_s_p50"] = NUM_PAGES / (figures["match_p50_ms"] / 1e3)
    figures["match_keys_per_s_per_shard_p50"] = figures["match_keys_per_s_p50"] / num_shards
    figures["cpu_us_per_call"] = cpu
    figures["throughput_keys_per_s"] = throughput
    figures["throughput_keys_per_s_per_shard"] = {n: v / num_shards
                                                  for n, v in throughput.items()}
    return figures


# ---- what a match adds to the ping floor, without Ray ---------------------------------------


def _median_us(run: Callable[[], object], reps: int) -> float:
    run()
    times_s = []
    for _ in range(reps):
        start_s = time.perf_counter()
        run()
        times_s.append(time.perf_counter() - start_s)
    return statistics.median(times_s) * 1e6


def measure_breakdown(reps: int) -> dict[str, float]:
    """In-process costs of one 512-key match: the index walk and (de)serialisation."""
    from cluster.directory_index import DirectoryIndex
    from cluster.geometry import HOST
    from cluster.keys import page_keys

    tokens = prompt_tokens()
    keys = page_keys(SPEC, "default", PAGE_TOKENS, tokens)
    node_id = "f" * 56  # a Ray node id is 56 hex characters
    index = DirectoryIndex()
    index.replace_node(node_id, 1, [(key, HOST) for key in keys], 1)
    answer = index.match(keys)
    assert len(answer) == NUM_PAGES, "the in-process index lost pages"
    keys_blob, answer_blob = pickle.dumps(keys, 5), pickle.dumps(answer, 5)
    return {
        "keys_us": _median_us(lambda: page_keys(SPEC, "default", PAGE_TOKENS, tokens), reps),
        "index_match_us": _median_us(lambda: index.match(keys), reps),
        "pickle_keys_us": _median_us(lambda: pickle.loads(pickle.dumps(keys, 5)), reps),
        "pickle_answer_us": _median_us(lambda: pickle.loads(pickle.dumps(answer, 5)), reps),
        "keys_bytes": len(keys_blob),
        "answer_bytes": len(answer_blob),
    }


# ---- ratios, report ------------------------------------------------------------------------


def ratios_of(per_shards: dict[str, dict]) -> dict[str, float]:
    one, two = per_shards["1"], per_shards.get("2")
    ratios = {
        "lookup_p50_vs_noop_rpc": one["match_p50_ms"] / one["ping_p50_ms"],
        "directory_vs_redis": one["redis_exists_p50_ms"] / one["match_p50_ms"],
        "lookup_e2e_p50_vs_noop_rpc": one["lookup_e2e_p50_ms"] / one["ping_p50_ms"],
        "lookup_p99_vs_noop_rpc_p99": one["match_p99_ms"] / one["ping_p99_ms"],
        "lookup_e2e_vs_redis": one["redis_exists_p50_ms"] / one["lookup_e2e_p50_ms"],
        "whatif_compact_match_p50_vs_noop_rpc": (one["compact_match_p50_ms"]
                                                 / one["compact_ping_p50_ms"]),
        "whatif_compact_vs_redis": one["redis_exists_p50_ms"] / one["compact_match_p50_ms"],
        "match_cpu_vs_noop_rpc_cpu": _cpu_us(one, "match") / _cpu_us(one, "ping"),
        "whatif_compact_match_cpu_vs_noop_rpc_cpu": (_cpu_us(one, "compact_match")
                                                     / _cpu_us(one, "compact_ping")),
    }
    if two is not None:
        threads = str(max(CLIENT_THREADS))
        ratios["lookup_p50_vs_noop_rpc_2_shards"] = two["match_p50_ms"] / two["ping_all_p50_ms"]
        ratios["shard_scaling_1_to_2"] = (two["throughput_keys_per_s"][threads]
                                          / one["throughput_keys_per_s"][threads])
        ratios["shard_scaling_1_to_2_one_client"] = (two["throughput_keys_per_s"]["1"]
                                                     / one["throughput_keys_per_s"]["1"])
        ratios["match_p50_2_vs_1_shards"] = two["match_p50_ms"] / one["match_p50_ms"]
    return ratios


ROWS = [("ping", "ping (no-op RPC)"), ("ping_all", "ping all shards"),
        ("match", "match, 512 keys"), ("lookup_e2e", "lookup e2e"),
        ("redis_exists", "redis EXISTS x512"), ("compact_ping", "what-if: ping"),
        ("compact_match", "what-if: match")]


CPU_ROWS = [("ping", "ping (one shard)"), ("match", "match (all shards)"),
            ("compact_ping", "what-if: ping"), ("compact_match", "what-if: match")]


def _cpu_us(figures: dict, name: str) -> float:
    cpu = figures["cpu_us_per_call"][name]
    return cpu["server_us"] + cpu["client_us"]


def _ratio_table(result: dict):
    from rich.table import Table

    table = Table(title="ratios (1 shard unless named)")
    for column in ("ratio", "value", "goal", "met"):
        table.add_column(column)
    for name, value in result["ratios"].items():
        goal = result["goals"].get(name, {})
        met = result["met"].get(name)
        text = " ".join(f"{'<=' if k == 'max' else '>='} {v}" for k, v in goal.items())
        table.add_row(name, f"{value:.3f}", text,
                      "" if met is None else ("[green]yes[/]" if met else "[red]NO[/]"))
    return table


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    shards = list(result["per_shards"])
    latency = Table(title=f"lookup of {NUM_TOKENS} tokens ({NUM_PAGES} pages), ms")
    latency.add_column("contender")
    for n in shards:
        latency.add_column(f"{n}sh p50", justify="right")
        latency.add_column(f"{n}sh p99", justify="right")
    for key, label in ROWS:
        cells = []
        for n in shards:
            figures = result["per_shards"][n]
            cells += [f"{figures[f'{key}_p50_ms']:.3f}", f"{figures[f'{key}_p99_ms']:.3f}"]
        latency.add_row(label, *cells)
    throughput = Table(title="match throughput, M page-keys/s")
    throughput.add_column("client threads")
    for n in shards:
        throughput.add_column(f"{n}sh total", justify="right")
        throughput.add_column(f"{n}sh /shard", justify="right")
    for threads in CLIENT_THREADS:
        cells = []
        for n in shards:
            figures = result["per_shards"][n]
            cells += [f"{figures['throughput_keys_per_s'][str(threads)] / 1e6:.3f}",
                      f"{figures['throughput_keys_per_s_per_shard'][str(threads)] / 1e6:.3f}"]
        throughput.add_row(str(threads), *cells)
    cpu = Table(title="CPU per call, us (called actor | client process)")
    cpu.add_column("call")
    for n in shards:
        cpu.add_column(f"{n}sh actor", justify="right")
        cpu.add_column(f"{n}sh client", justify="right")
    for key, label in CPU_ROWS:
        cells = []
        for n in shards:
            figures = result["per_shards"][n]["cpu_us_per_call"][key]
            cells += [f"{figures['server_us']:.0f}", f"{figures['client_us']:.0f}"]
        cpu.add_row(label, *cells)
    breakdown = Table(title="one 512-key match without Ray")
    breakdown.add_column("part")
    breakdown.add_column("value", justify="right")
    for name, value in result["breakdown"].items():
        breakdown.add_row(name, f"{value:.1f}")
    console = Console()
    for table in (latency, cpu, throughput, breakdown, _ratio_table(result)):
        console.print(table)


NOTES = [
    "latencies: p50/p99 over REPS interleaved repetitions from the driver of a private local "
    "Ray (2 CPUs); every repetition times each contender once, order rotating",
    "lookup_p50_vs_noop_rpc = match p50 / shard.ping p50 with 1 shard (match is given "
    "precomputed keys); lookup_e2e_* include computing the 512 keys (blake3 chain over 128K "
    "tokens); lookup_p50_vs_noop_rpc_2_shards divides by the ping-every-shard p50",
    "directory_vs_redis = redis EXISTS-pipeline p50 / match p50 (1 shard); Redis runs on "
    "loopback, one pipeline of 512 EXISTS per lookup, redis-py with hiredis",
    "throughput: closed-loop match calls from 1 and 2 threads of the driver, the median of "
    "THROUGHPUT_WINDOWS windows (alternating thread counts) of THROUGHPUT_S / windows "
    "each; shard_scaling_1_to_2 = 2-shard / 1-shard page-keys/s with 2 client threads. "
    "On 2 cores the driver threads (GIL-bound), the shard actors, the node actor and Ray's "
    "raylet/GCS share 2 CPUs: a second shard adds an RPC per lookup and no free core, so "
    "this ratio shows the cost of sharding here, not the capacity a second machine adds",
    "what-if (not raykv): CompactShard, an actor defined in this benchmark, answers the same "
    "512 keys sent as one bytes blob from a dict of shared location tuples, run-length "
    "encoded; whatif_compact_match_p50_vs_noop_rpc = its match p50 / its own ping p50; "
    "whatif_compact_vs_redis = redis EXISTS-pipeline p50 / its match p50",
    "CPU per call: REPS sequential calls each, CPU time of every thread of the called "
    "actor process(es) (/proc/<pid>/task/*/schedstat) and of this client process "
    "(process_time), divided by REPS; *_cpu_vs_noop_rpc_cpu compare actor + client CPU. On "
    "a loaded 2-core machine wall time inflates CPU time, so these say where work is",
    "breakdown: the same work without Ray, in this process: computing the keys, "
    "DirectoryIndex.match, and pickle round trips of the keys and of the answer (what the "
    "shard and the client add to the ping floor, apart from copying the bytes)",
]


def run(json_path: str | None, quick: bool) -> dict:
    from rich.progress import Progress

    from cluster.redis_server import RedisServer

    reps = QUICK_REPS if quick else REPS
    duration_s = QUICK_THROUGHPUT_S if quick else THROUGHPUT_S
    machine = {**machine_info(), "loadavg_start": list(os.getloadavg())}
    per_shards: dict[str, dict] = {}
    started_ray = ensure_local_ray()
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-dir-", dir="/tmp")
    try:
        with RedisServer() as redis_server, Progress() as progress:
            task = progress.add_task("directory", total=len(SHARD_COUNTS) + 1)
            for num_shards in SHARD_COUNTS:
                progress.update(task, description=f"{num_shards} shard(s)")
                per_shards[str(num_shards)] = measure_shards(num_shards, disk_dir,
                                                             redis_server.url, reps, duration_s)
                progress.advance(task)
            progress.update(task, description="breakdown")
            breakdown = measure_breakdown(INDEX_REPS)
            progress.advance(task)
    finally:
        try:
            stop_service()
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
            if started_ray:
                ray.shutdown()
    machine["loadavg_end"] = list(os.getloadavg())
    ratios = ratios_of(per_shards)
    result = {"benchmark": "directory", "unit": "ms (latency), page-keys/s (throughput)",
              "config": {"num_tokens": NUM_TOKENS, "page_tokens": PAGE_TOKENS,
                         "num_pages": NUM_PAGES, "page_bytes": SPEC.page_bytes(PAGE_TOKENS),
                         "reps": reps, "warmup_reps": WARMUP_REPS,
                         "throughput_s": duration_s,
                         "throughput_windows": THROUGHPUT_WINDOWS,
                         "client_threads": list(CLIENT_THREADS),
                         "shard_counts": list(SHARD_COUNTS), "quick": quick},
              "machine": machine, "per_shards": per_shards, "breakdown": breakdown,
              "ratios": ratios, "goals": GOALS, "met": goals_met(ratios, GOALS),
              "notes": NOTES + (["quick run: fewer repetitions, shorter throughput runs"]
                                if quick else [])}
    print_report(result)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(result, file, indent=2)
    return result
