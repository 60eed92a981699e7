"""`raykv bench directory`: longest-prefix lookup of a 128K-token prompt vs its floors and peers.

A 128K-token prompt (512 pages of 256 tokens, 16 KiB each) is put through the client for real,
then, from the driver on a private local Ray, side by side in one interleaved loop (REPS times;
each repetition times every contender once, in a rotating order, so that a noisy neighbour slows
them all alike):

    ping             shard.ping: a no-op call to a directory shard actor      (the RPC floor)
    ping all         ray.get of a ping to every shard at once (= ping with 1 shard)
    shard match      ray.get(shard.match(keys_blob)) on every shard at once, blobs prepared
                     beforehand, runs not expanded                     (the wire call alone)
    match            client.directory.match(keys): keys precomputed; split by shard, one blob
                     per shard, one RPC per shard in parallel, runs expanded and merged
                                                                       (the directory's part)
    lookup e2e       client.lookup(tokens): page keys (blake3 chain) + match
    redis EXISTS     one pipelined EXISTS per key of the same 512 keys, SET beforehand
                     (redis-py + hiredis, loopback TCP)                              (peer)

for 1 and 2 directory shards (the service stopped and started in between). Then throughput:
match calls in a closed loop from 1 and 2 client threads, in page-keys/s, in total and per
shard, and the CPU each call costs in the shard process(es) and in the client. The machine has
2 cores shared by the driver, the shards, the node actor and Ray's own processes, so shard
scaling here shows overhead, not capacity.

Breakdown (no Ray): the same 512-key match in-process, step by step: keys, blob join, the
shard's split, DirectoryIndex.prefix_runs, expanding the runs, pickling the blob and the answer.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import ray

from actors.handles import expand_runs, split_by_shard
from cluster.core.config import CacheConfig
from cluster.core.keys import KEY_BYTES
from cluster.core.spec import ModelSpec
from cluster.tools.bench import common
from cluster.tools.bench.peers import RedisExists

MiB = common.MiB
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
CONTENDERS = ("ping", "ping_all", "shard_match", "match", "lookup_e2e", "redis_exists")
CPU_CALLS = ("ping", "shard_match", "match")


def prompt_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, NUM_TOKENS, dtype=np.int64)


def _service_config(num_shards: int, disk_dir: str) -> CacheConfig:
    return CacheConfig(page_tokens=PAGE_TOKENS, num_directory_shards=num_shards,
                       host_bytes=HOST_BYTES, device_bytes=0, disk_bytes=0,
                       disk_dir=os.path.join(disk_dir, f"shards-{num_shards}"))


def _start_client(num_shards: int, disk_dir: str, tokens: np.ndarray):
    """The service with num_shards shards, holding the prompt (put and found again)."""
    client = common.start_service(_service_config(num_shards, disk_dir), SPEC)
    stored = client.put(tokens, common.page_kv(SPEC, PAGE_TOKENS, NUM_PAGES))
    if stored != NUM_TOKENS:
        raise RuntimeError(f"put stored {stored} of {NUM_TOKENS} tokens")
    found = client.lookup(tokens)
    if found != NUM_TOKENS:
        raise RuntimeError(f"lookup found {found} of {NUM_TOKENS} tokens after the put")
    return client


def _shard_match(directory, keys: list) -> Callable[[], int]:
    """The raw wire call: every shard's prefix_runs(blob) at once; pages found, summed over
    shards (the blobs are joined inside the timed call, as a client does)."""
    def call() -> int:
        _, refs = directory.prefix_refs(keys)
        return sum(count for runs in ray.get(refs) for _, count in runs)

    return call


def _no_count(call: Callable[[], object]) -> Callable[[], None]:
    """A no-op RPC: it finds nothing, so measure_latency checks no count."""
    def run() -> None:
        call()

    return run


def _contenders(client, tokens: np.ndarray, keys: list, redis: RedisExists
                ) -> dict[str, Callable[[], int | None]]:
    """name -> a call returning how many pages it found (a lookup must find them all), or
    None for a no-op."""
    directory = client.directory
    return {
        "ping": _no_count(lambda: ray.get(directory.ping()[0])),
        "ping_all": _no_count(lambda: ray.get(directory.ping())),
        "shard_match": _shard_match(directory, keys),
        "match": lambda: len(client.locate_keys(keys)),
        "lookup_e2e": lambda: client.lookup(tokens) // PAGE_TOKENS,
        "redis_exists": redis.longest_prefix,
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
            elapsed_s, found = common.timed(contenders[name])
            times_s[name].append(elapsed_s)
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
                if len(client.locate_keys(keys)) != NUM_PAGES:
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
    return common.medians(windows)


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


def measure_cpu(contenders: dict[str, Callable], shard_pids: list[int],
                calls: int) -> dict[str, dict[str, float]]:
    """CPU microseconds per call in the called shard(s) and in this (client) process."""
    cpu = {}
    for name in CPU_CALLS:
        pids = shard_pids[:1] if name == "ping" else shard_pids
        client_ns, server_ns = time.process_time_ns(), _cpu_ns(pids)
        for _ in range(calls):
            contenders[name]()
        cpu[name] = {"server_us": (_cpu_ns(pids) - server_ns) / calls / 1e3,
                     "client_us": (time.process_time_ns() - client_ns) / calls / 1e3}
    return cpu


def _latency_figures(times_s: dict[str, list[float]]) -> dict[str, float]:
    figures = {}
    for name, values in times_s.items():
        figures.update({f"{name}_{stat}": value
                        for stat, value in common.latency_ms(values).items()})
    return figures


def measure_shards(num_shards: int, disk_dir: str, redis_url: str, reps: int,
                   duration_s: float) -> dict:
    tokens = prompt_tokens()
    client = _start_client(num_shards, disk_dir, tokens)
    keys = client.keys(tokens)
    redis = RedisExists(redis_url, keys)
    try:
        contenders = _contenders(client, tokens, keys, redis)
        times_s = measure_latency(contenders, reps)
        cpu = measure_cpu(contenders, [_pid_of(s) for s in client.directory.shards], reps)
        throughput = measure_throughputs(client, keys, duration_s)
    finally:
        redis.close()
    figures: dict = {"num_shards": num_shards, **_latency_figures(times_s)}
    figures["match_keys_per_s_p50"] = NUM_PAGES / (figures["match_p50_ms"] / 1e3)
    figures["cpu_us_per_call"] = cpu
    figures["throughput_keys_per_s"] = throughput
    figures["throughput_keys_per_s_per_shard"] = {n: v / num_shards
                                                  for n, v in throughput.items()}
    return figures


# ---- what a match adds to the ping floor, without Ray ---------------------------------------


def measure_breakdown(reps: int) -> dict[str, float]:
    """In-process costs of one 512-key match, step by step, in us (and the wire bytes)."""
    from cluster.core.directory_index import DirectoryIndex
    from cluster.core.geometry import HOST
    from cluster.core.keys import page_keys

    tokens = prompt_tokens()
    keys = page_keys(SPEC, "default", PAGE_TOKENS, tokens)
    index = DirectoryIndex()
    index.replace_node("f" * 56, 1, [(key, HOST) for key in keys], 1)  # a Ray node id: 56 hex
    blob = b"".join(keys)
    runs = index.prefix_runs(keys)
    assert len(expand_runs(runs)) == NUM_PAGES, "the in-process index lost pages"
    steps = {
        "keys": lambda: page_keys(SPEC, "default", PAGE_TOKENS, tokens),
        "split_by_shard_and_join": lambda: [b"".join(keys[p] for p in positions)
                                            for positions in split_by_shard(keys, 1)],
        "shard_split_blob": lambda: [blob[i:i + KEY_BYTES]
                                     for i in range(0, len(blob), KEY_BYTES)],
        "prefix_runs": lambda: index.prefix_runs(keys),
        "expand_runs": lambda: expand_runs(runs),
        "pickle_blob": lambda: pickle.loads(pickle.dumps(blob, 5)),
        "pickle_answer": lambda: pickle.loads(pickle.dumps(runs, 5)),
    }
    figures = {f"{name}_us": common.warm_median_s(run, reps) * 1e6
               for name, run in steps.items()}
    return {**figures, "keys_blob_bytes": len(blob),
            "answer_bytes": len(pickle.dumps(runs, 5)), "answer_runs": len(runs)}


# ---- ratios, report ------------------------------------------------------------------------


def _cpu_us(figures: dict, name: str) -> float:
    cpu = figures["cpu_us_per_call"][name]
    return cpu["server_us"] + cpu["client_us"]


def ratios_of(per_shards: dict[str, dict]) -> dict[str, float]:
    one, two = per_shards["1"], per_shards.get("2")
    ratios = {
        "lookup_p50_vs_noop_rpc": one["match_p50_ms"] / one["ping_p50_ms"],
        "directory_vs_redis": one["redis_exists_p50_ms"] / one["match_p50_ms"],
        "shard_match_p50_vs_noop_rpc": one["shard_match_p50_ms"] / one["ping_p50_ms"],
        "lookup_p99_vs_noop_rpc_p99": one["match_p99_ms"] / one["ping_p99_ms"],
        "lookup_e2e_p50_vs_noop_rpc": one["lookup_e2e_p50_ms"] / one["ping_p50_ms"],
        "lookup_e2e_vs_redis": one["redis_exists_p50_ms"] / one["lookup_e2e_p50_ms"],
        "match_cpu_vs_noop_rpc_cpu": _cpu_us(one, "match") / _cpu_us(one, "ping"),
    }
    if two is not None:
        threads = str(max(CLIENT_THREADS))
        ratios["lookup_p50_vs_noop_rpc_2_shards"] = two["match_p50_ms"] / two["ping_all_p50_ms"]
        ratios["match_p50_2_vs_1_shards"] = two["match_p50_ms"] / one["match_p50_ms"]
        ratios["shard_scaling_1_to_2"] = (two["throughput_keys_per_s"][threads]
                                          / one["throughput_keys_per_s"][threads])
        ratios["shard_scaling_1_to_2_one_client"] = (two["throughput_keys_per_s"]["1"]
                                                     / one["throughput_keys_per_s"]["1"])
    return ratios


LABELS = {"ping": "ping (no-op RPC)", "ping_all": "ping all shards",
          "shard_match": "shard.match(blob), raw", "match": "client.directory.match",
          "lookup_e2e": "client.lookup (keys + match)", "redis_exists": "redis EXISTS x512"}


def _tables(result: dict) -> list:
    per_shards = result["per_shards"]
    shards = list(per_shards)
    latency = common.table(
        f"lookup of {NUM_TOKENS} tokens ({NUM_PAGES} pages), ms",
        ["contender", *(f"{n}sh {s}" for n in shards for s in ("p50", "p99"))],
        ([LABELS[key], *(f"{per_shards[n][f'{key}_{s}_ms']:.3f}"
                         for n in shards for s in ("p50", "p99"))] for key in CONTENDERS))
    cpu = common.table(
        "CPU per call, us (called shard(s) | client process)",
        ["call", *(f"{n}sh {side}" for n in shards for side in ("shard", "client"))],
        ([LABELS[key], *(f"{per_shards[n]['cpu_us_per_call'][key][f'{side}_us']:.0f}"
                         for n in shards for side in ("server", "client"))]
         for key in CPU_CALLS))
    throughput = common.table(
        "match throughput, M page-keys/s",
        ["client threads", *(f"{n}sh {kind}" for n in shards for kind in ("total", "/shard"))],
        ([str(t), *(f"{per_shards[n][key][str(t)] / 1e6:.3f}" for n in shards
                    for key in ("throughput_keys_per_s", "throughput_keys_per_s_per_shard"))]
         for t in CLIENT_THREADS))
    breakdown = common.table("one 512-key match without Ray", ["part", "value"],
                             ([name, f"{value:.1f}"]
                              for name, value in result["breakdown"].items()))
    return [latency, cpu, throughput, breakdown]


NOTES = [
    "latencies: p50/p99 over REPS interleaved repetitions from the driver of a private local "
    "Ray (2 CPUs); every repetition times each contender once, order rotating",
    "lookup_p50_vs_noop_rpc = client.directory.match(keys) p50 / shard.ping p50 with 1 shard "
    "(keys precomputed; the client joins them into one blob, the shard answers in runs "
    "[[locations, num_pages]], the client expands them); shard_match_p50_vs_noop_rpc: the "
    "raw ray.get(shard.match(blob)) with the blob prepared and the runs left as they are; "
    "lookup_e2e_* include computing the 512 keys (blake3 chain over 128K tokens); "
    "lookup_p50_vs_noop_rpc_2_shards divides by the ping-every-shard p50",
    "directory_vs_redis = redis EXISTS-pipeline p50 / match p50 (1 shard); Redis runs on "
    "loopback, one pipeline of 512 EXISTS per lookup, redis-py with hiredis",
    "throughput: closed-loop match calls from 1 and 2 threads of the driver, the median of "
    "THROUGHPUT_WINDOWS windows (alternating thread counts) of THROUGHPUT_S / windows "
    "each; shard_scaling_1_to_2 = 2-shard / 1-shard page-keys/s with 2 client threads. "
    "On 2 cores the driver threads (GIL-bound), the shard actors, the node actor and Ray's "
    "raylet/GCS share 2 CPUs, so this shows the cost of sharding here, not its capacity",
    "CPU per call: REPS sequential calls each, CPU time of every thread of the called "
    "shard process(es) (/proc/<pid>/task/*/schedstat) and of this client process "
    "(process_time), divided by REPS; match_cpu_vs_noop_rpc_cpu compares shard + client CPU",
    "breakdown: the steps of one match without Ray, in this process (us): keys, the "
    "client's split and join into one blob, the shard's split of the blob, match_runs, "
    "expand_runs, and pickle round trips of the blob and of the answer",
]


def measure_all(reps: int, duration_s: float, disk_dir: str) -> tuple[dict, dict]:
    from rich.progress import Progress

    from cluster.tools.redis_server import RedisServer

    per_shards: dict[str, dict] = {}
    with RedisServer() as redis_server, Progress() as progress:
        steps = common.Steps(progress, "directory", len(SHARD_COUNTS) + 1)
        for num_shards in SHARD_COUNTS:
            steps(f"{num_shards} shard(s)")
            per_shards[str(num_shards)] = measure_shards(num_shards, disk_dir,
                                                         redis_server.url, reps, duration_s)
        steps("breakdown")
        breakdown = measure_breakdown(INDEX_REPS)
    return per_shards, breakdown


def run(json_path: str | None, quick: bool) -> dict:
    reps = QUICK_REPS if quick else REPS
    duration_s = QUICK_THROUGHPUT_S if quick else THROUGHPUT_S
    machine = common.machine_info()
    started_ray = common.ensure_local_ray(OBJECT_STORE_BYTES, num_cpus=2)
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-dir-", dir="/tmp")
    try:
        per_shards, breakdown = measure_all(reps, duration_s, disk_dir)
    finally:
        try:
            common.stop_service()
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
            if started_ray:
                ray.shutdown()
    result = {"benchmark": "directory", "unit": "ms (latency), page-keys/s (throughput)",
              "config": {"num_tokens": NUM_TOKENS, "page_tokens": PAGE_TOKENS,
                         "num_pages": NUM_PAGES, "page_bytes": SPEC.page_bytes(PAGE_TOKENS),
                         "reps": reps, "warmup_reps": WARMUP_REPS, "throughput_s": duration_s,
                         "throughput_windows": THROUGHPUT_WINDOWS,
                         "client_threads": list(CLIENT_THREADS),
                         "shard_counts": list(SHARD_COUNTS), "quick": quick},
              "machine": machine, "per_shards": per_shards, "breakdown": breakdown,
              "ratios": ratios_of(per_shards), "goals": GOALS,
              "notes": NOTES + (["quick run: fewer repetitions, shorter throughput runs"]
                                if quick else [])}
    common.print_tables(_tables(result))
    return common.finish(result, json_path)
