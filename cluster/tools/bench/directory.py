"""`raykv bench directory`: longest-prefix lookup of a 128K-token prompt vs a no-op RPC and Redis.

A 128K-token prompt (512 pages of 256 tokens) is put through the client for real. Then, from
the driver of a private local Ray, for 1 and then 2 directory shards (the service restarted in
between), harness.interleave runs these contenders in rotating order, each round a batch of
calls of each (their p50 is the round's figure):

    noop        a no-op `ping` sent to every shard that a lookup asks (all of them: the client
                splits the keys by shard and asks each shard once, in parallel), awaited as a
                lookup awaits its answers (cluster.calls.run_sync: ray.wait, then ray.get)
                                                                        (the RPC floor)
    match       client.locate_keys(keys): keys precomputed; one blob per shard, one call per
                shard in parallel, the answers' runs expanded and merged  (the directory's part)
    lookup_e2e  client.lookup(tokens): the page keys (blake3 chain) + match
    redis       Redis doing the walk server-side: the same 512 keys SET beforehand on a real
                redis-server (loopback), one EVALSHA of a Lua script that walks the keys until
                the first miss and returns the prefix length (redis-py + hiredis, 1 connection)

Every call's answer is checked (all 512 pages found; every shard answered the ping), and,
outside the timing, raykv and the Lua walk must give the same prefix length on the full key
list and on one that misses after PARTIAL_PAGES pages. A wrong answer makes its ratios null
(the run fails). Ratios are medians of per-round ratios (harness.Report.paired).

Breakdown (no Ray): the same 512-key match in-process, step by step: keys, the client's split
and join into one blob, the shard's split, DirectoryIndex.prefix_runs, expanding the runs,
pickling the blob and the answer.
"""

from __future__ import annotations

import os
import pickle
import shutil
import statistics
import tempfile
from collections.abc import Callable

import numpy as np
import ray

from actors.handles import expand_runs, split_by_shard
from cluster.calls import Wait, run_sync
from cluster.core.config import CacheConfig
from cluster.core.keys import KEY_BYTES
from cluster.core.spec import ModelSpec
from cluster.tools.bench import common, harness
from cluster.tools.bench.peers import _redis_client

PAGE_TOKENS = 256
NUM_PAGES = 512
NUM_TOKENS = NUM_PAGES * PAGE_TOKENS  # 128K tokens
PARTIAL_PAGES = 300  # the checked stop: raykv and the Lua walk must both stop here
SHARD_COUNTS = (1, 2)
ROUNDS, QUICK_ROUNDS = 9, 3
CALLS_PER_ROUND, QUICK_CALLS_PER_ROUND = 40, 15
WARMUP_CALLS = 20
INDEX_REPS = 50
HOST_BYTES = 32 * common.MiB  # the 8 MiB prompt and room to spare
OBJECT_STORE_BYTES = 128 * common.MiB
VOCAB = 128_256
# 2 x 1 layer x 1 kv head x 16 x fp16 = 64 B per token: a 256-token page is 16 KiB.
SPEC = ModelSpec("bench-dir", 1, 1, 16, "float16")
GOALS = {"lookup_p50_vs_noop_rpc": {"max": 1.5}, "directory_vs_redis": {"min": 2.0}}
CONTENDERS = ("noop", "match", "lookup_e2e", "redis")
# What a user would run instead: the keys in Redis and the walk in Redis itself, one round trip.
LUA_PREFIX_WALK = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""


def prompt_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, NUM_TOKENS, dtype=np.int64)


def missing_keys(num_keys: int) -> list[bytes]:
    """Keys no one stored (random 16-byte values, like real keys)."""
    blob = np.random.default_rng(1).bytes(num_keys * KEY_BYTES)
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


class RedisPrefixWalk:
    """A page directory on Redis: each page key SET (its value a location), a lookup one
    EVALSHA of LUA_PREFIX_WALK over the keys. The server is ours alone; the keys are deleted
    on close."""

    def __init__(self, url: str, keys: list[bytes]) -> None:
        self.client = _redis_client(url)
        self.keys = list(keys)
        self.walk = self.client.register_script(LUA_PREFIX_WALK)
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.set(key, b"node-0:host")
        pipe.execute()

    def longest_prefix(self, keys: list[bytes] | None = None) -> int:
        """How many leading keys (default: all that were SET) Redis holds, in pages."""
        return int(self.walk(keys=self.keys if keys is None else keys))

    def close(self) -> None:
        self.client.delete(*self.keys)
        self.client.close()


def _noop_steps(directory):
    """A ping to every shard, awaited as a lookup's calls are (cluster.calls.Wait)."""
    return (yield Wait(directory.ping()))


class Batches:
    """Contenders for harness.interleave: each round runs `calls` timed calls of a contender,
    keeps every time and counts the answers that were not the expected one; the round's figure
    is the batch's p50 in seconds."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.times_s: dict[str, list[float]] = {}
        self.wrong: dict[str, int] = {}

    def contender(self, name: str, call: Callable[[], object],
                  expected: object) -> Callable[[int], float]:
        self.times_s[name], self.wrong[name] = [], 0

        def run(_round: int) -> float:
            batch_s = []
            for _ in range(self.calls):
                elapsed_s, answer = common.timed(call)
                batch_s.append(elapsed_s)
                self.wrong[name] += answer != expected
            self.times_s[name].extend(batch_s)
            return statistics.median(batch_s)

        return run


def _contenders(client, tokens: np.ndarray, walk: RedisPrefixWalk,
                batches: Batches) -> dict[str, Callable[[int], float]]:
    keys, directory = walk.keys, client.directory
    calls = {
        "noop": (lambda: sorted(run_sync(_noop_steps(directory), client.timeout_s)),
                 list(range(len(directory.shards)))),
        "match": (lambda: len(client.locate_keys(keys)), NUM_PAGES),
        "lookup_e2e": (lambda: client.lookup(tokens), NUM_TOKENS),
        "redis": (walk.longest_prefix, NUM_PAGES),
    }
    for call, _ in calls.values():
        for _ in range(WARMUP_CALLS):
            call()
    return {name: batches.contender(name, call, expected)
            for name, (call, expected) in calls.items()}


def prefix_agreement(client, walk: RedisPrefixWalk) -> dict[str, list[int]]:
    """Outside the timing: the prefix length (pages) raykv and the Lua walk give for the full
    key list and for one whose keys after PARTIAL_PAGES were never stored."""
    partial = walk.keys[:PARTIAL_PAGES] + missing_keys(NUM_PAGES - PARTIAL_PAGES)
    return {"expected": [NUM_PAGES, PARTIAL_PAGES],
            "raykv": [len(client.locate_keys(k)) for k in (walk.keys, partial)],
            "redis": [walk.longest_prefix(k) for k in (walk.keys, partial)]}


def _service_config(num_shards: int, disk_dir: str) -> CacheConfig:
    return CacheConfig(page_tokens=PAGE_TOKENS, num_directory_shards=num_shards,
                       host_bytes=HOST_BYTES, device_bytes=0, disk_bytes=0,
                       disk_dir=os.path.join(disk_dir, f"shards-{num_shards}"))


def _start_client(num_shards: int, disk_dir: str, tokens: np.ndarray):
    """The service with num_shards shards, holding the prompt (put, then found again)."""
    client = common.start_service(_service_config(num_shards, disk_dir), SPEC)
    stored = client.put(tokens, common.page_kv(SPEC, PAGE_TOKENS, NUM_PAGES))
    if stored != NUM_TOKENS or client.lookup(tokens) != NUM_TOKENS:
        raise RuntimeError(f"the put stored {stored} of {NUM_TOKENS} tokens or was not found")
    return client


def measure_shards(num_shards: int, disk_dir: str, redis_url: str, num_rounds: int,
                   calls: int) -> dict:
    """One service run: per-round p50s (ms), pooled p50/p99 (ms), wrong answers, agreement."""
    tokens = prompt_tokens()
    client = _start_client(num_shards, disk_dir, tokens)
    walk = RedisPrefixWalk(redis_url, client.keys(tokens))
    batches = Batches(calls)
    try:
        rounds = harness.interleave(_contenders(client, tokens, walk, batches), num_rounds)
        agreement = prefix_agreement(client, walk)
    finally:
        walk.close()
    return {"num_shards": num_shards,
            "p50_ms_per_round": {n: [s * 1e3 for s in v] for n, v in rounds.items()},
            **{f"{stat}_ms": {n: common.percentile_ms(v, q) for n, v in batches.times_s.items()}
               for stat, q in (("p50", 50), ("p99", 99))},
            "wrong_answers": batches.wrong, "prefix_agreement": agreement}


# ---- ratios --------------------------------------------------------------------------------


PAIRS = {"lookup_p50_vs_noop_rpc": ("match", "noop"), "directory_vs_redis": ("redis", "match"),
         "lookup_e2e_p50_vs_noop_rpc": ("lookup_e2e", "noop"),
         "lookup_e2e_vs_redis": ("redis", "lookup_e2e")}


def _unsound(figures: dict, contenders: tuple[str, str]) -> str:
    """Why a ratio of these two contenders cannot stand ("" when it can): a wrong answer, or
    raykv and the Lua walk disagreeing on a prefix length."""
    wrongs = {name: figures["wrong_answers"][name] for name in contenders
              if figures["wrong_answers"][name]}
    if wrongs:
        return f"wrong answers: {wrongs}"
    agreement = figures["prefix_agreement"]
    if "redis" in contenders and not (
            agreement["raykv"] == agreement["redis"] == agreement["expected"]):
        return f"raykv and Redis disagree on the prefix: {agreement}"
    return ""


def add_ratios(report: harness.Report, per_shards: dict[str, dict]) -> None:
    """The paired ratios of each shard count (the contract's names at 1 shard, `_2_shards`
    after them for 2), each null when an answer it rests on was wrong."""
    for shards, figures in per_shards.items():
        suffix = "" if shards == "1" else f"_{shards}_shards"
        rounds = figures["p50_ms_per_round"]
        for name, (top, bottom) in PAIRS.items():
            why = _unsound(figures, (top, bottom))
            if report.require(name + suffix, not why, why):
                report.paired(name + suffix, rounds[top], rounds[bottom])


# ---- what a match adds to the no-op floor, without Ray --------------------------------------


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


# ---- report --------------------------------------------------------------------------------


def _tables(per_shards: dict, breakdown: dict) -> list:
    latency = common.table(
        f"lookup of {NUM_TOKENS} tokens ({NUM_PAGES} pages), ms over every call",
        ["contender", *(f"{n}sh {s}" for n in per_shards for s in ("p50", "p99"))],
        ([name, *(f"{per_shards[n][f'{s}_ms'][name]:.3f}"
                  for n in per_shards for s in ("p50", "p99"))] for name in CONTENDERS))
    parts = common.table("one 512-key match without Ray", ["part", "value"],
                         ([name, f"{value:.1f}"] for name, value in breakdown.items()))
    return [latency, parts]


NOTES = [
    f"workload: one prompt of {NUM_TOKENS} tokens = {NUM_PAGES} pages of {PAGE_TOKENS} tokens "
    "(16 KiB each), put once; every lookup finds all of it; 1 and 2 directory shards, private "
    "local Ray with 2 CPUs; Redis: a real redis-server on loopback, our own",
    "rounds: harness.interleave, contenders in rotating order; a round runs a batch of calls "
    "per contender (after a warm-up), its figure the batch's p50; ratios are medians of the "
    "per-round ratios; p50_ms/p99_ms pool every call",
    "lookup_p50_vs_noop_rpc = client.locate_keys(keys) / a no-op ping to the same shards "
    "(every shard, as a lookup asks every shard), both awaited through cluster.calls.run_sync; "
    "keys precomputed. lookup_e2e_* add the page keys (blake3 chain over 128K tokens)",
    "directory_vs_redis = Redis / raykv: one EVALSHA of a Lua walk (EXISTS key by key until the "
    "first miss, the prefix length back; less than raykv's answer, which carries locations) "
    "over the same 512 keys, one connection, redis-py with hiredis; its prefix lengths are "
    f"checked against raykv's, full and stopping at page {PARTIAL_PAGES}",
    "the ratios suffixed _2_shards: the same with 2 directory shards (the noop pings both)",
    "breakdown: the steps of one match without Ray, in this process (us)",
]


def measure_all(num_rounds: int, calls: int, disk_dir: str) -> tuple[dict, dict]:
    from rich.progress import Progress

    from cluster.tools.redis_server import RedisServer

    per_shards: dict[str, dict] = {}
    with RedisServer() as redis_server, Progress() as progress:
        steps = common.Steps(progress, "directory", len(SHARD_COUNTS) + 1)
        for num_shards in SHARD_COUNTS:
            steps(f"{num_shards} shard(s)")
            per_shards[str(num_shards)] = measure_shards(num_shards, disk_dir, redis_server.url,
                                                         num_rounds, calls)
        steps("breakdown")
        breakdown = measure_breakdown(INDEX_REPS)
    return per_shards, breakdown


def run(json_path: str | None, quick: bool) -> dict:
    num_rounds = QUICK_ROUNDS if quick else ROUNDS
    calls = QUICK_CALLS_PER_ROUND if quick else CALLS_PER_ROUND
    config = {"num_tokens": NUM_TOKENS, "page_tokens": PAGE_TOKENS, "num_pages": NUM_PAGES,
              "page_bytes": SPEC.page_bytes(PAGE_TOKENS), "rounds": num_rounds,
              "calls_per_round": calls, "warmup_calls": WARMUP_CALLS,
              "shard_counts": list(SHARD_COUNTS), "quick": quick}
    report = harness.Report("directory", "ms", config, GOALS, NOTES)
    started_ray = common.ensure_local_ray(OBJECT_STORE_BYTES, num_cpus=2)
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-dir-", dir="/tmp")
    try:
        per_shards, breakdown = measure_all(num_rounds, calls, disk_dir)
    finally:
        try:
            common.stop_service()
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
            if started_ray:
                ray.shutdown()
    report["per_shards"], report["breakdown"] = per_shards, breakdown
    add_ratios(report, per_shards)
    common.print_tables(_tables(per_shards, breakdown))
    return report.finish(json_path)
