"""`raykv bench hashing`: what computing page keys costs, in ns per prompt token.

Side by side, in one run and over the same prompt bytes (128K tokens, little-endian uint32):

    page_keys (numpy ids)   the client's path: validate + canonicalise + chained blake3 per page
    page_keys (list ids)    the same from a Python list of ints (what many engines hold)
    blake3 chain            the design's floor: blake3(prev | page bytes) per page, nothing else
    xxh3_128 chain          the same chain with xxh3-128 (the design's other allowed hash)
    blake3 / xxh3_128       one call over all the bytes (hash throughput, no per-page cost)
    memcpy                  np.copyto of the token bytes (touching the bytes once)

Each figure is the median of REPS timed runs after a warm-up. No Ray.
"""

from __future__ import annotations

from collections.abc import Callable

import blake3
import numpy as np
import xxhash

from cluster.core.keys import KEY_BYTES, canonical_tokens, chain_keys, namespace_key, page_keys
from cluster.core.spec import ModelSpec
from cluster.tools.bench.common import finish, machine_info, print_tables, table, warm_median_s

NUM_TOKENS = 128 * 1024
QUICK_TOKENS = 16 * 1024
PAGE_TOKENS = (256, 16)
REPS = 15
QUICK_REPS = 7
VOCAB = 128_256  # Llama-3 vocabulary: ids need the full uint32 range's low 17 bits
SPEC = ModelSpec.preset("llama-3.1-8b")
NAMESPACE = "default"
GOALS = {"hash_ns_per_token": {"max": 30.0}}
NOTES = ("hash_ns_per_token: cluster.core.keys.page_keys over a NUM_TOKENS prompt given as a numpy "
         "int64 array, page_tokens 256, median ns per token; the _pt16 and _list ratios are "
         "the same at page_tokens 16 and from a Python list (informational, no goal); "
         "hash_vs_blake3_chain = page_keys / a bare Python loop of chained blake3 calls.")


def median_ns_per_token(run: Callable[[], object], num_tokens: int, reps: int) -> float:
    """Warm up once, then the median of `reps` timed calls, in ns per token."""
    return warm_median_s(run, reps) / num_tokens * 1e9


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


def _memcpy(src: np.ndarray, dst: np.ndarray) -> Callable[[], None]:
    return lambda: np.copyto(dst, src)


def measure(num_tokens: int, page_tokens_list: tuple[int, ...], reps: int) -> dict:
    """ns per token of every contender; {"per_page_tokens": {pt: {...}}, "whole_prompt": {...}}."""
    ids = np.random.default_rng(0).integers(0, VOCAB, num_tokens, dtype=np.int64)
    ids_list = ids.tolist()
    canonical = canonical_tokens(ids)
    data = canonical.tobytes()
    time_it = lambda run: median_ns_per_token(run, num_tokens, reps)  # noqa: E731
    per_size: dict[str, dict[str, float]] = {}
    for page_tokens in page_tokens_list:
        root = namespace_key(SPEC, NAMESPACE, page_tokens)
        per_size[str(page_tokens)] = {
            "page_keys_numpy": time_it(lambda pt=page_tokens: page_keys(SPEC, NAMESPACE, pt, ids)),
            "page_keys_list": time_it(
                lambda pt=page_tokens: page_keys(SPEC, NAMESPACE, pt, ids_list)),
            "chain_keys_only": time_it(lambda pt=page_tokens, r=root: chain_keys(canonical, r, pt)),
            "blake3_chain": time_it(lambda pt=page_tokens, r=root: _chain(_blake3_16, data, r, pt)),
            "xxh3_128_chain": time_it(
                lambda pt=page_tokens, r=root: _chain(xxhash.xxh3_128_digest, data, r, pt)),
        }
    dst = np.empty_like(canonical)
    dst.fill(0)
    whole = {
        "blake3_oneshot": time_it(lambda: _blake3_16(data)),
        "xxh3_128_oneshot": time_it(lambda: xxhash.xxh3_128_digest(data)),
        "memcpy": time_it(_memcpy(canonical, dst)),
        "canonical_tokens_numpy": time_it(lambda: canonical_tokens(ids)),
        "canonical_tokens_list": time_it(lambda: canonical_tokens(ids_list)),
    }
    return {"per_page_tokens": per_size, "whole_prompt": whole}


def ratios_of(figures: dict) -> dict[str, float]:
    main = figures["per_page_tokens"][str(PAGE_TOKENS[0])]
    ratios = {"hash_ns_per_token": main["page_keys_numpy"],
              "hash_ns_per_token_list": main["page_keys_list"],
              "hash_vs_blake3_chain": main["page_keys_numpy"] / main["blake3_chain"]}
    small = figures["per_page_tokens"].get(str(PAGE_TOKENS[1]))
    if small is not None:
        ratios["hash_ns_per_token_pt16"] = small["page_keys_numpy"]
    return ratios


def print_report(result: dict) -> None:
    sizes = list(result["per_page_tokens"])
    rows = [[name, *(f"{result['per_page_tokens'][s][name]:.2f}" for s in sizes)]
            for name in result["per_page_tokens"][sizes[0]]]
    rows += [[name, f"{value:.2f}", *[""] * (len(sizes) - 1)]
             for name, value in result["whole_prompt"].items()]
    print_tables([table(f"page-key hashing, {result['config']['num_tokens']} tokens (ns/token)",
                        ["contender", *(f"page_tokens={s}" for s in sizes)], rows)])


def run(json_path: str | None, quick: bool) -> dict:
    num_tokens = QUICK_TOKENS if quick else NUM_TOKENS
    reps = QUICK_REPS if quick else REPS
    machine = {**machine_info(), "blake3": blake3.__version__, "xxhash": xxhash.VERSION}
    figures = measure(num_tokens, PAGE_TOKENS, reps)
    result = {"benchmark": "hashing", "unit": "ns per token",
              "config": {"num_tokens": num_tokens, "page_tokens": list(PAGE_TOKENS),
                         "reps": reps, "model": SPEC.name, "quick": quick},
              "machine": machine, **figures, "ratios": ratios_of(figures), "goals": GOALS,
              "notes": NOTES}
    print_report(result)
    return finish(result, json_path)
