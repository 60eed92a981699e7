"""`raykv bench ttft`: time to first token of an ~8K-token prompt whose first ~7.5K tokens are
cached, on the tiny model on CPU, in one run:

    host        the prefix's pages in the host tier: the engine's aget + the suffix's prefill
    disk        the same pages on the disk tier (raw pages), read back by that get
    recompute   no cache: the whole prompt is prefilled
    ideal       the suffix alone, with the prefix's KV already in the engine's memory

Each case is the engine's own path (Engine.generate, one new token), timed to its first token;
medians of REPS. The service runs on a private local Ray; device tier off, so a cached page is
in exactly the tier the case names.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time

from cluster.core.config import MiB
from cluster.tools.bench import common

MODEL = "tiny-llama"
PROMPT_TOKENS = 8192
CACHED_TOKENS = 7680  # 30 pages of 256
PAGE_TOKENS = 256
REPS, QUICK_REPS = 9, 3
GOALS = {"ttft_host_vs_ideal": {"max": 1.15}, "ttft_disk_vs_ideal": {"max": 1.5}}
NOTES = ("TTFT = Engine.generate to its first token (fetch of the cached prefix into a "
         "preallocated buffer + prefill of the rest + sampling), on one event loop kept for the "
         "whole run as a replica's is, the request already tokenized (the ingress does it); "
         "ideal = prefill of the rest with the prefix's KV already in memory; medians. "
         "engine_phases_ms: the engine's own fetch_s and prefill_s of each timed request.")


def prompt_text(index: int, num_chars: int) -> str:
    """A distinct printable prompt per index (one byte, one token)."""
    words = [f"w{index}x{i % 97}" for i in range(num_chars // 4 + 1)]
    return " ".join(words)[: num_chars - 1]  # +1 BOS token


def _config(disk_dir: str):
    from cluster import CacheConfig

    prompt_bytes = 256 * PROMPT_TOKENS  # tiny-llama: 256 bytes of KV per token
    return CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=0, host_bytes=3 * prompt_bytes,
                       disk_bytes=64 * prompt_bytes, disk_dir=disk_dir, disk_codec="none")


class Bench:
    """The engine driven as a replica drives it: one event loop for the whole run (so its
    worker threads, and their torch/OpenMP state, persist across requests), and requests that
    arrive tokenized (the ingress tokenizes; the ideal is given tokens too)."""

    def __init__(self, engine, client):
        self.engine, self.client = engine, client
        self.loop = asyncio.new_event_loop()
        self.phases_ms: dict[str, dict[str, list[float]]] = {}

    def close(self) -> None:
        self.loop.close()

    def request(self, text: str):
        from cluster.serving import tokenizer
        from cluster.serving.engine import GenerationRequest
        from cluster.serving.sampling import SamplingParams

        return GenerationRequest(text, tokenizer.encode(text), SamplingParams(max_tokens=1))

    def ttft_s(self, text: str, case: str = "") -> tuple[float, int]:
        """(seconds to the first token, cached tokens used); the engine's own fetch and
        prefill seconds are kept under `case`."""
        request = self.request(text)

        async def run():
            start_s = time.perf_counter()
            head = None
            async for chunk in self.engine.generate(request):
                head = head or chunk
                if chunk.text or chunk.finish_reason:
                    elapsed_s = time.perf_counter() - start_s
                    break
            await self.engine.drain()
            return elapsed_s, head

        elapsed_s, head = self.loop.run_until_complete(run())
        if case:
            phases = self.phases_ms.setdefault(case, {"fetch": [], "prefill": []})
            phases["fetch"].append(head.fetch_s * 1e3)
            phases["prefill"].append(head.prefill_s * 1e3)
        return elapsed_s, head.cached_tokens

    def cache(self, text: str) -> None:
        """Store the first CACHED_TOKENS tokens' pages (a full prefill, untimed)."""
        from cluster.serving import tokenizer
        from cluster.serving.model import kv_from_cache, prefill_from

        tokens = tokenizer.encode(text)[:CACHED_TOKENS]
        _, cache = prefill_from(self.engine.model, None, tokens)
        stored = self.client.put(tokens, kv_from_cache(cache))
        if stored != CACHED_TOKENS:
            raise RuntimeError(f"put stored {stored} of {CACHED_TOKENS} tokens")

    def push_to_disk(self, index: int) -> None:
        """Fill the host tier with other pages, so earlier prompts' pages go down to disk."""
        for filler in range(4):
            self.cache(prompt_text(10_000 + index * 10 + filler, PROMPT_TOKENS))

    def ideal_s(self, text: str) -> float:
        from cluster.serving import tokenizer
        from cluster.serving.model import kv_from_cache, prefill_from
        from cluster.serving.sampling import Sampler, SamplingParams

        tokens = tokenizer.encode(text)
        _, cache = prefill_from(self.engine.model, None, tokens[:CACHED_TOKENS])
        kv = kv_from_cache(cache)
        sampler = Sampler(SamplingParams(), self.engine.mask)
        start_s = time.perf_counter()
        logits, _ = prefill_from(self.engine.model, kv, tokens)
        sampler.next(logits)
        return time.perf_counter() - start_s


def measure(bench: Bench, reps: int, steps) -> dict:
    times: dict[str, list[float]] = {"host": [], "disk": [], "recompute": [], "ideal": []}
    cached: dict[str, list[int]] = {"host": [], "disk": []}
    for rep in range(reps):
        steps(f"rep {rep + 1}/{reps}")
        text = prompt_text(rep, PROMPT_TOKENS)
        # A prompt of its own: the engine stores what it computed, and a recompute of a text
        # sharing `text`'s prefix would cache more of `text` than the host case is meant to.
        times["recompute"].append(
            bench.ttft_s(prompt_text(500 + rep, PROMPT_TOKENS), "recompute")[0])
        times["ideal"].append(bench.ideal_s(text))
        bench.cache(text)
        elapsed_s, used = bench.ttft_s(text, "host")
        times["host"].append(elapsed_s)
        cached["host"].append(used)
        disk_text = prompt_text(1000 + rep, PROMPT_TOKENS)
        bench.cache(disk_text)
        bench.push_to_disk(rep)
        elapsed_s, used = bench.ttft_s(disk_text, "disk")
        times["disk"].append(elapsed_s)
        cached["disk"].append(used)
    return {"ttft_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "cached_tokens": cached, "engine_phases_ms": bench.phases_ms}


def ratios_of(figures: dict) -> dict[str, float]:
    median = {k: statistics.median(v) for k, v in figures["ttft_ms"].items()}
    return {"ttft_host_vs_ideal": median["host"] / median["ideal"],
            "ttft_disk_vs_ideal": median["disk"] / median["ideal"],
            "ttft_speedup_host": median["recompute"] / median["host"],
            "ttft_speedup_disk": median["recompute"] / median["disk"]}


def run(json_path: str | None, quick: bool) -> dict:
    from rich.progress import Progress

    from cluster import connect, stop
    from cluster.core.spec import ModelSpec
    from cluster.serving.engine import Engine, EngineConfig

    reps = QUICK_REPS if quick else REPS
    started = common.ensure_local_ray(256 * MiB)
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-ttft-", dir="/tmp")
    try:
        common.stop_service()
        from cluster import start

        start(_config(disk_dir))
        client = connect(ModelSpec.preset(MODEL))
        engine = Engine(EngineConfig(MODEL, max_context_tokens=PROMPT_TOKENS + 64),
                        {"default": client})
        bench = Bench(engine, client)
        try:
            with Progress() as progress:
                figures = measure(bench, reps, common.Steps(progress, "ttft", reps))
        finally:
            bench.close()
        stats = client.stats()["node"]
    finally:
        stop()
        shutil.rmtree(disk_dir, ignore_errors=True)
        if started:
            import ray

            ray.shutdown()
    medians = {k: statistics.median(v) for k, v in figures["ttft_ms"].items()}
    result = {"benchmark": "ttft", "unit": "ms",
              "config": {"model": MODEL, "prompt_tokens": PROMPT_TOKENS,
                         "cached_tokens": CACHED_TOKENS, "page_tokens": PAGE_TOKENS,
                         "reps": reps, "quick": quick},
              "machine": common.machine_info(), **figures, "ttft_ms_median": medians,
              "node_disk_bytes_read": stats.get("disk_bytes_read"),
              "ratios": ratios_of(figures), "goals": GOALS, "notes": NOTES}
    phases = {case: {name: statistics.median(v) for name, v in p.items()}
              for case, p in figures["engine_phases_ms"].items()}
    rows = [[k, f"{v:.1f}", f"{phases[k]['fetch']:.1f}" if k in phases else "",
             f"{phases[k]['prefill']:.1f}" if k in phases else ""] for k, v in medians.items()]
    common.print_tables([common.table("TTFT (ms), median", ["case", "ms", "engine fetch",
                                                           "engine prefill"], rows)])
    return common.finish(result, json_path)
