"""`raykv bench hashing`: what computing page keys costs, in ns per prompt token. No Ray.

Over the same prompt (128K tokens), harness.interleave runs these contenders in rotating order,
each round's figure the median of a few calls, in ns per token:

    keys (list ids)     KeyChain.keys(list of ints): what KVClient.keys, the ingress and the
                        vLLM connector run on the token ids they hold (Python lists):
                        validate + canonicalise to little-endian uint32 + chained blake3 per page
    keys (numpy ids)    the same from a numpy int64 array
    blake3 chain        the design's floor: blake3(prev | page bytes) per page in a bare loop,
                        one hasher reset per page (the leanest loop: a fresh hasher a page
                        costs 0.65 against 0.40 us at 16-token pages)
    xxh3_128 chain      the same chain with xxh3-128 (the design's other allowed hash), one
                        xxh3_128_digest call a page (leaner than a reused xxh3 hasher)

at page_tokens 256 and 16, and over the whole prompt: canonical_tokens from a list and from
numpy, and one blake3 call over all the bytes (hash throughput, no per-page cost). Outside the
timing, both key paths and the blake3 chain must give the same keys.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import blake3
import numpy as np
import xxhash

from cluster.core.keys import KEY_BYTES, KeyChain, canonical_tokens
from cluster.core.spec import ModelSpec
from cluster.tools.bench import harness
from cluster.tools.bench.common import print_tables, table, timed

NUM_TOKENS, QUICK_TOKENS = 128 * 1024, 16 * 1024
PAGE_TOKENS = (256, 16)
ROUNDS, QUICK_ROUNDS = 7, 3
CALLS_PER_ROUND = 3
VOCAB = 128_256  # Llama-3 vocabulary: ids need the full uint32 range's low 17 bits
SPEC = ModelSpec.preset("llama-3.1-8b")
NAMESPACE = "default"
SECRET = b"bench-namespace-secret"  # a namespace's secret, as a client's chain has one
GOALS = {"hash_ns_per_token": {"max": 30.0}}
NOTES = ("hash_ns_per_token: KeyChain.keys (what KVClient.keys runs; root precomputed, with a "
         "namespace secret) over a NUM_TOKENS prompt given as a Python list of ints, as the "
         "ingress, the engine and the vLLM connector hold token ids; page_tokens 256; the "
         "median over rounds of each round's median ns per token. _numpy: the same from a "
         "numpy int64 array; _pt16: at page_tokens 16 (informational, no goal). "
         "hash_vs_blake3_chain = keys (numpy ids) / a bare Python loop of chained blake3 "
         "calls, paired per round; it is null unless both give the same keys.")


def _chain(hash_bytes: Callable[[bytes], bytes], data: bytes, root: bytes,
           page_tokens: int) -> list[bytes]:
    """key_i = hash(key_i-1 | page i's bytes): the leanest Python loop of the chain."""
    stride = page_tokens * 4
    keys, previous = [], root
    for offset in range(0, len(data) - stride + 1, stride):
        previous = hash_bytes(previous + data[offset : offset + stride])
        keys.append(previous)
    return keys


def _blake3_16(data: bytes) -> bytes:
    return blake3.blake3(data).digest(KEY_BYTES)


def _blake3_chain(data: bytes, root: bytes, page_tokens: int) -> list[bytes]:
    """The blake3 chain's leanest Python loop: one hasher, reset for each page."""
    stride = page_tokens * 4
    hasher = blake3.blake3()
    keys, previous = [], root
    for offset in range(0, len(data) - stride + 1, stride):
        hasher.reset()
        hasher.update(previous)
        hasher.update(data[offset : offset + stride])
        previous = hasher.digest(KEY_BYTES)
        keys.append(previous)
    return keys


def calls_of(num_tokens: int, page_tokens_list: tuple[int, ...]) -> dict[str, Callable]:
    """name -> a call over the same prompt: "<call>_pt<page tokens>" per page size, and the
    whole-prompt calls."""
    ids = np.random.default_rng(0).integers(0, VOCAB, num_tokens, dtype=np.int64)
    ids_list = ids.tolist()
    data = canonical_tokens(ids).tobytes()
    calls: dict[str, Callable] = {}
    for pt in page_tokens_list:
        chain = KeyChain.of(SPEC, NAMESPACE, pt, SECRET)
        calls.update({f"keys_list_pt{pt}": lambda c=chain: c.keys(ids_list),
                      f"keys_numpy_pt{pt}": lambda c=chain: c.keys(ids),
                      f"blake3_chain_pt{pt}": lambda c=chain, p=pt: _blake3_chain(data, c.root,
                                                                                   p),
                      f"xxh3_128_chain_pt{pt}": lambda c=chain, p=pt: _chain(
                          xxhash.xxh3_128_digest, data, c.root, p)})
    calls.update({"canonical_tokens_list": lambda: canonical_tokens(ids_list),
                  "canonical_tokens_numpy": lambda: canonical_tokens(ids),
                  "blake3_oneshot": lambda: _blake3_16(data)})
    return calls


def same_keys(calls: dict[str, Callable], page_tokens_list: tuple[int, ...]) -> bool:
    """Both key paths and the bare blake3 chain give the same keys, at every page size."""
    return all(calls[f"keys_list_pt{pt}"]() == calls[f"keys_numpy_pt{pt}"]()
               == calls[f"blake3_chain_pt{pt}"]() for pt in page_tokens_list)


def per_round_ns(calls: dict[str, Callable], num_tokens: int,
                 num_rounds: int) -> dict[str, list[float]]:
    """name -> each round's median ns per token (CALLS_PER_ROUND timed calls, after one
    untimed warm-up call of each)."""
    for call in calls.values():
        call()

    def contender(call: Callable) -> Callable[[int], float]:
        return lambda _round: statistics.median(
            timed(call)[0] for _ in range(CALLS_PER_ROUND)) / num_tokens * 1e9

    return harness.interleave({name: contender(call) for name, call in calls.items()},
                              num_rounds)


def add_ratios(report: harness.Report, rounds: dict[str, list[float]], keys_agree: bool) -> None:
    main, small = PAGE_TOKENS
    for name, series in (("hash_ns_per_token", f"keys_list_pt{main}"),
                         ("hash_ns_per_token_numpy", f"keys_numpy_pt{main}"),
                         ("hash_ns_per_token_pt16", f"keys_list_pt{small}")):
        report.ratio(name, statistics.median(rounds[series]), rounds[series])
    if report.require("hash_vs_blake3_chain", keys_agree,
                      "KeyChain.keys and the bare blake3 chain gave different keys"):
        report.paired("hash_vs_blake3_chain", rounds[f"keys_numpy_pt{main}"],
                      rounds[f"blake3_chain_pt{main}"])


def print_report(result: dict) -> None:
    medians = result["ns_per_token"]
    rows = [[name, f"{value:.2f}"] for name, value in medians.items()]
    print_tables([table(f"page-key hashing, {result['config']['num_tokens']} tokens, "
                        "ns/token (median of rounds)", ["contender", "ns/token"], rows)])


def run(json_path: str | None, quick: bool) -> dict:
    num_tokens = QUICK_TOKENS if quick else NUM_TOKENS
    num_rounds = QUICK_ROUNDS if quick else ROUNDS
    config = {"num_tokens": num_tokens, "page_tokens": list(PAGE_TOKENS), "rounds": num_rounds,
              "calls_per_round": CALLS_PER_ROUND, "model": SPEC.name, "quick": quick}
    report = harness.Report("hashing", "ns per token", config, GOALS, NOTES)
    report["machine"].update(blake3=blake3.__version__, xxhash=xxhash.VERSION)
    calls = calls_of(num_tokens, PAGE_TOKENS)
    keys_agree = same_keys(calls, PAGE_TOKENS)
    rounds = per_round_ns(calls, num_tokens, num_rounds)
    report["ns_per_token_per_round"] = rounds
    report["ns_per_token"] = {name: statistics.median(v) for name, v in rounds.items()}
    add_ratios(report, rounds, keys_agree)
    print_report(report.result)
    return report.finish(json_path)
