"""`raykv bench ttft`: time to first token of an ~8K-token prompt whose first ~7.5K tokens are
cached, on the tiny model on CPU, four cases paired per repetition:

    host        the prefix's pages in the host tier: the engine's aget + the suffix's prefill
    disk        the same pages on the disk tier (raw pages), read back by that get
    recompute   no cache: the whole prompt is prefilled
    ideal       the suffix alone, with the prefix's KV already in the engine's memory, on
                the engine's compute thread as its own prefills are

Each repetition (a harness.interleave round) first, untimed, caches the disk case's prefix,
puts enough other prompts to push it from the host tier to disk, then caches the host case's
prefix, and lets the node's loop demote ahead of need as it does between a replica's requests
(at most 1 s: the host tier's learned headroom free, cluster/core/demote_ahead.py); then it
runs the four cases once each, in an order rotating per repetition. Every case of every
repetition has a prompt of its own, so that no case finds another's pages. Each case
is the engine's own path (Engine.generate, one new token), timed to its first token. The host
case must use all the cached tokens with no disk read, the disk case all of them with the
node's disk-read counter rising by at least their bytes; otherwise its ratio is null. Ratios
are medians of the per-repetition ratios. The service runs on a private local Ray; the device
tier is off and eviction is LRU, so a cached page is in exactly the tier the case names.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time

from cluster.core.config import MiB
from cluster.core.spec import ModelSpec
from cluster.tools.bench import common, harness

MODEL = "tiny-llama"
PROMPT_TOKENS = 8192
CACHED_TOKENS = 7680  # 30 pages of 256
PAGE_TOKENS = 256
KV_BYTES_PER_TOKEN = ModelSpec.preset(MODEL).bytes_per_token  # 512: a page is 128 KiB
# The host tier holds this many prompts' KV. A round leaves up to 96 pages there (the host and
# disk cases' prompts and the recompute case's stored pages), which must fit beside the room the
# node keeps free for a read-up (its learned headroom, 30 to 32 pages here: demote_ahead.py) and
# the engine's client's put lease, or the host case's own prefix is demoted before it runs (seen
# with 4: two of nine repetitions read it from disk).
HOST_PROMPTS = 5
REPS, QUICK_REPS = 9, 3
CASES = ("host", "disk", "recompute", "ideal")
# ttft_disk_vs_ideal: the hot-path issue (#20) asks for <= 1.3 (it was 1.5 before it)
GOALS = {"ttft_host_vs_ideal": {"max": 1.15}, "ttft_disk_vs_ideal": {"max": 1.3}}
NOTES = (f"workload: tiny-llama on CPU, prompts of {PROMPT_TOKENS} tokens whose first "
         f"{CACHED_TOKENS} ({CACHED_TOKENS // PAGE_TOKENS} pages of {PAGE_TOKENS}) are cached; "
         "one new token. TTFT = Engine.generate to its first token (fetch of the cached prefix "
         "into a preallocated buffer + prefill of the rest + sampling), on one event loop kept "
         "for the whole run as a replica's is, the request already tokenized (the ingress does "
         "it); ideal = prefill of the rest with the prefix's KV already in memory, on the "
         "engine's compute thread (every prefill of the run, the untimed ones too, runs there, "
         "as in a replica: another thread's torch work slows the next prefill). Each "
         "repetition runs host, disk, recompute and ideal once, in rotating order, after one "
         "untimed warm-up repetition; ratios are medians of per-repetition ratios. "
         "engine_phases_ms: the engine's own fetch_s and prefill_s of each timed request, and "
         "disk_read: the client's own reads of the node's slab files during it (wall time, "
         "part of the fetch: cluster/disk_direct.py), node_disk_read: the node's batched disk "
         "reads during it (an acquire's read-up, part of the fetch; or, after the client read "
         "the pages itself, their read-up into host, off the request's path); "
         "checks: per repetition, cached tokens used and disk bytes read during the case.")


def prompt_text(index: int, num_chars: int) -> str:
    """A distinct printable prompt per index (one byte, one token)."""
    words = [f"w{index}x{i % 97}" for i in range(num_chars // 4 + 1)]
    return " ".join(words)[: num_chars - 1]  # +1 BOS token


def case_texts(rep: int) -> dict[str, str]:
    """The prompts of repetition `rep`, one per case, distinct across cases and repetitions."""
    return {case: prompt_text(offset * 1000 + rep, PROMPT_TOKENS)
            for offset, case in enumerate(CASES)}


def num_fillers(host_pages: int, cached_pages: int) -> int:
    """Prompts to cache after the disk case's so that LRU has pushed all its pages to disk."""
    return host_pages // cached_pages + 1


def _config(disk_dir: str):
    from cluster import CacheConfig

    prompt_bytes = KV_BYTES_PER_TOKEN * PROMPT_TOKENS
    return CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=0,
                       host_bytes=HOST_PROMPTS * prompt_bytes, disk_bytes=64 * prompt_bytes,
                       disk_dir=disk_dir, disk_codec="none", eviction="lru")


class Bench:
    """The engine driven as a replica drives it: one event loop for the whole run (so its
    worker threads, and their torch/OpenMP state, persist across requests), and requests that
    arrive tokenized (the ingress tokenizes; the ideal is given tokens too)."""

    def __init__(self, engine, client):
        self.engine, self.client = engine, client
        self.loop = asyncio.new_event_loop()
        self.phases_ms: dict[str, dict[str, list[float]]] = {}
        self.checks: dict[str, dict[str, list[int]]] = {
            case: {"cached_tokens": [], "disk_bytes_read": []} for case in ("host", "disk")}

    def close(self) -> None:
        self.loop.close()

    def ttft_s(self, text: str, case: str) -> float:
        """Seconds to the first token; the engine's fetch and prefill seconds are kept under
        `case`, and for host and disk the cached tokens used and the disk bytes read."""
        from cluster.serving import tokenizer
        from cluster.serving.engine import GenerationRequest
        from cluster.serving.sampling import SamplingParams

        request = GenerationRequest(text, tokenizer.encode(text), SamplingParams(max_tokens=1))

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

        bytes_before, reads_s_before = self.disk_reads()
        elapsed_s, head = self.loop.run_until_complete(run())
        self.quiesce()
        bytes_read, reads_s = self.disk_reads()
        if case in self.checks:
            self.checks[case]["cached_tokens"].append(head.cached_tokens)
            self.checks[case]["disk_bytes_read"].append(bytes_read - bytes_before)
        phases = self.phases_ms.setdefault(case, {"fetch": [], "prefill": [], "disk_read": [],
                                                  "node_disk_read": []})
        phases["fetch"].append(head.fetch_s * 1e3)
        phases["prefill"].append(head.prefill_s * 1e3)
        phases["disk_read"].append((reads_s[0] - reads_s_before[0]) * 1e3)
        phases["node_disk_read"].append((reads_s[1] - reads_s_before[1]) * 1e3)
        return elapsed_s

    def quiesce(self, timeout_s: float = 1.0) -> None:
        """Untimed: let the node finish what the request set off in the background (a disk
        page the client read itself is read up into host once the node hears of it), so that
        it lands in this case's checks, not the next case's: until the node's disk reads
        stop moving for 50 ms, at most `timeout_s`."""
        deadline_s = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline_s:
            now = self.client.stats()["node"]["disk_bytes_read"]  # sends the touches first
            if now == last:
                return
            last = now
            time.sleep(0.05)

    def disk_reads(self) -> tuple[int, tuple[float, float]]:
        """The disk reads so far, the engine's client's own (a get reads the node's slab
        files itself: cluster/disk_direct.py) and the node's: (their bytes, (the client's
        seconds, the node's seconds))."""
        node = self.client.stats()["node"]
        counters = self.client.view.counters
        direct_bytes = counters["disk_direct_pages"] * self.client.geometry.page_bytes
        return (int(node["disk_bytes_read"]) + direct_bytes,
                (counters["disk_direct_us"] / 1e6, float(node["disk_read_s"])))

    def cache(self, text: str) -> None:
        """Store the first CACHED_TOKENS tokens' pages (a full prefill, untimed)."""
        from cluster.serving import tokenizer

        tokens = tokenizer.encode(text)[:CACHED_TOKENS]
        kv = self.engine.on_compute_thread(_prefilled_kv, self.engine.model, tokens)
        stored = self.client.put(tokens, kv)
        if stored != CACHED_TOKENS:
            raise RuntimeError(f"put stored {stored} of {CACHED_TOKENS} tokens")

    def prepare(self, rep: int) -> None:
        """The disk case's prefix cached, then pushed to disk by fillers; then the host case's
        prefix cached (the newest pages, so LRU keeps it on host through the round); then a
        pause, at most 1 s, for the node's demotion ahead of need."""
        texts = case_texts(rep)
        self.cache(texts["disk"])
        cached_pages = CACHED_TOKENS // PAGE_TOKENS
        for filler in range(num_fillers(HOST_PROMPTS * PROMPT_TOKENS // PAGE_TOKENS,
                                        cached_pages)):
            self.cache(prompt_text(100_000 + rep * 10 + filler, PROMPT_TOKENS))
        self.cache(texts["host"])
        self.settle()

    def settle(self, timeout_s: float = 1.0) -> None:
        """Untimed: let the node's loop demote ahead between requests, as it does between a
        replica's requests (cluster/core/demote_ahead.py), until the host tier's learned
        headroom is free; at most `timeout_s`."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if not self.client.stats()["node"].get("host_headroom_short_pages", 0):
                return
            time.sleep(0.01)

    def ideal_s(self, text: str) -> float:
        """The ideal: the rest prefilled on the engine's compute thread, where its own prefills
        run (engine.py: another thread's torch work would slow the next prefill), from the
        prefix's KV already in memory; then sampled as the engine samples."""
        from cluster.serving import tokenizer
        from cluster.serving.model import prefill_from
        from cluster.serving.sampling import Sampler, SamplingParams

        tokens = tokenizer.encode(text)
        kv = self.engine.on_compute_thread(_prefilled_kv, self.engine.model,
                                           tokens[:CACHED_TOKENS])
        sampler = Sampler(SamplingParams(), self.engine.mask)
        start_s = time.perf_counter()
        logits, _ = self.engine.on_compute_thread(prefill_from, self.engine.model, kv, tokens)
        sampler.next(logits)
        return time.perf_counter() - start_s

    def contenders(self) -> dict:
        """case -> the case's TTFT in ms for repetition `rep` (harness.interleave)."""
        def case(name: str):
            if name == "ideal":
                return lambda rep: self.ideal_s(case_texts(rep)["ideal"]) * 1e3
            return lambda rep: self.ttft_s(case_texts(rep)[name], name) * 1e3

        return {name: case(name) for name in CASES}


def _prefilled_kv(model, tokens: list[int]):
    """The KV of `tokens`, prefilled from nothing (run on the engine's compute thread)."""
    from cluster.serving.model import kv_from_cache, prefill_from

    return kv_from_cache(prefill_from(model, None, tokens)[1])


def measure(bench: Bench, reps: int, steps) -> dict[str, list[float]]:
    """Per case, its TTFT (ms) in each repetition, after one untimed warm-up repetition."""
    contenders = bench.contenders()
    steps("warm-up")
    bench.engine.warm_up()
    bench.prepare(reps)  # the warm-up repetition's prompts come after the timed ones'
    for contender in contenders.values():
        contender(reps)
    bench.phases_ms.clear()
    bench.checks = {case: {k: [] for k in v} for case, v in bench.checks.items()}

    def on_round(rep: int, order: list[str]) -> None:
        steps(f"rep {rep + 1}/{reps}: {', '.join(order)}")
        bench.prepare(rep)

    return harness.interleave(contenders, reps, on_round)


def exercised(checks: dict[str, dict[str, list[int]]]) -> dict[str, str]:
    """case -> why it was not exercised ("" when it was): host must use every cached token and
    read nothing from disk, disk every cached token and at least their bytes from disk."""
    prefix_bytes = CACHED_TOKENS * KV_BYTES_PER_TOKEN
    why = {}
    for case, check in checks.items():
        used, read = check["cached_tokens"], check["disk_bytes_read"]
        bad_use = [n for n in used if n != CACHED_TOKENS]
        bad_read = [n for n in read if (n != 0 if case == "host" else n < prefix_bytes)]
        why[case] = (f"cached tokens used {used} (expected {CACHED_TOKENS} each)" if bad_use
                     else f"disk bytes read {read} during the {case} case" if bad_read else "")
    return why


def add_ratios(report: harness.Report, ttft_ms: dict[str, list[float]],
               checks: dict[str, dict[str, list[int]]]) -> None:
    why = exercised(checks)
    for case in ("host", "disk"):
        if report.require(f"ttft_{case}_vs_ideal", not why[case], why[case]):
            report.paired(f"ttft_{case}_vs_ideal", ttft_ms[case], ttft_ms["ideal"])
        if report.require(f"ttft_speedup_{case}", not why[case], why[case]):
            report.paired(f"ttft_speedup_{case}", ttft_ms["recompute"], ttft_ms[case])


def _print(ttft_ms: dict[str, list[float]], phases_ms: dict) -> None:
    rows = [[case, f"{statistics.median(ttft_ms[case]):.1f}",
             *(f"{statistics.median(phases_ms[case][p]):.1f}" if case in phases_ms else ""
               for p in ("fetch", "disk_read", "prefill", "node_disk_read"))]
            for case in CASES]
    common.print_tables([common.table("TTFT (ms), median", [
        "case", "ms", "engine fetch", "of which its own disk read", "engine prefill",
        "node's disk reads (on or off the path)"], rows)])


def run(json_path: str | None, quick: bool) -> dict:
    from rich.progress import Progress

    from cluster import connect, start, stop
    from cluster.serving.engine import Engine, EngineConfig

    reps = QUICK_REPS if quick else REPS
    config = {"model": MODEL, "prompt_tokens": PROMPT_TOKENS, "cached_tokens": CACHED_TOKENS,
              "page_tokens": PAGE_TOKENS, "host_prompts": HOST_PROMPTS, "reps": reps,
              "quick": quick}
    report = harness.Report("ttft", "ms", config, GOALS, NOTES)
    started = common.ensure_local_ray(256 * MiB)
    disk_dir = tempfile.mkdtemp(prefix="raykv-bench-ttft-", dir="/tmp")
    try:
        common.stop_service()
        start(_config(disk_dir))
        client = connect(ModelSpec.preset(MODEL))
        engine = Engine(EngineConfig(MODEL, max_context_tokens=PROMPT_TOKENS + 64),
                        {"default": client})
        bench = Bench(engine, client)
        try:
            with Progress() as progress:
                ttft_ms = measure(bench, reps, common.Steps(progress, "ttft", reps + 1))
        finally:
            bench.close()
    finally:
        stop()
        shutil.rmtree(disk_dir, ignore_errors=True)
        if started:
            import ray

            ray.shutdown()
    report["ttft_ms"], report["checks"] = ttft_ms, bench.checks
    report["ttft_ms_median"] = common.medians(ttft_ms)
    report["engine_phases_ms"] = bench.phases_ms
    add_ratios(report, ttft_ms, bench.checks)
    _print(ttft_ms, bench.phases_ms)
    return report.finish(json_path)
