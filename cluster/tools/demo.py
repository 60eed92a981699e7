"""`raykv demo`: a small real Llama stores and reuses its KV through raykv on a simulated cluster.

    Cluster (one raylet per simulated node, each offering the kv_node resource)
      head node: driver (model + KVClient) <--shm--> node actor: device | host | disk (int8)
      worker nodes: node actors, and one "replica" task that reads the system prompt remotely

Workload: a shared system prompt, then several users' multi-turn conversations. Each prompt
looks up its cached prefix, fetches it, runs only the rest of the prompt, and stores its KV.
A full recompute of every prompt gives the reference time and logits.

Hits by tier: before each get, the directory's longest-prefix match names the tier of every
matched page (a put flushes its events, so the directory is current); the get then promotes
them. The node actor's own `hits_pages` counter cross-checks the total.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cluster.core.config import MiB
from cluster.core.geometry import TIER_NAMES

PAGE_TOKENS = 16
SYSTEM_TOKENS = 256
NUM_USERS = 3
NUM_TURNS = 2
# (user message, assistant reply) lengths per turn; odd sizes leave partial pages.
TURN_TOKENS = ((83, 57), (61, 0))
VOCAB = 512
OBJECT_STORE_BYTES = 150 * MiB
TIMING_REPEATS = 7
# A small random-weight Llama (4 layers, hidden 512): big enough that its prefill costs more
# than fetching its cached KV, as with real models; the tiny test model is not.
MODEL_PRESET = "small-llama"
# Per-node tier budgets in pages: small device and host tiers, so older pages spill to disk.
DEVICE_PAGES = 24
HOST_PAGES = 8
DISK_PAGES = 256
DISK_CODEC = "int8"


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str
    tokens: list[int]


@dataclass(slots=True)
class PromptResult:
    name: str
    num_tokens: int
    cached_tokens: int
    hits_by_tier: dict[str, int]
    full_ms: float
    fetch_ms: float
    rest_ms: float
    max_logit_diff: float
    top1_match: bool

    @property
    def cached_ms(self) -> float:
        return self.fetch_ms + self.rest_ms if self.cached_tokens else self.full_ms

    @property
    def speedup(self) -> float:
        return self.full_ms / self.cached_ms if self.cached_ms > 0 else 0.0


# ---- workload -----------------------------------------------------------------------------


def make_workload(seed: int = 0) -> list[Prompt]:
    """A shared system prompt, then each user's turns, interleaved across users."""
    generator = torch.Generator().manual_seed(seed)

    def random_tokens(num_tokens: int) -> list[int]:
        return torch.randint(0, VOCAB, (num_tokens,), generator=generator).tolist()

    system = random_tokens(SYSTEM_TOKENS)
    history = {user: list(system) for user in range(NUM_USERS)}
    prompts = []
    for turn, (message_tokens, reply_tokens) in enumerate(TURN_TOKENS[:NUM_TURNS]):
        for user in range(NUM_USERS):
            history[user] += random_tokens(message_tokens)
            prompts.append(Prompt(f"user{user + 1}/turn{turn + 1}", list(history[user])))
            history[user] += random_tokens(reply_tokens)  # the model's answer, next turn's history
    return prompts


def _best_ms(fn, repeats: int = TIMING_REPEATS):
    """(fastest wall time in ms, the last result) over `repeats` calls.

    The fastest run is the least disturbed one on a small machine shared with Ray's daemons.
    """
    times_ms, result = [], None
    for _ in range(repeats):
        start_s = time.perf_counter()
        result = fn()
        times_ms.append((time.perf_counter() - start_s) * 1e3)
    return min(times_ms), result


# ---- serving one prompt ---------------------------------------------------------------------


def _hit_tiers(client, tokens: list[int]) -> list[int]:
    """The tier of each page of the cached prefix, as the directory sees it before the get."""
    located = client.locate_keys(client.keys(tokens))
    home = client.home.node_id
    return [next((tier for node, tier in places if node == home), places[0][1])
            for places in located]


def serve_prompt(client, model, prompt: Prompt) -> PromptResult:
    """Reuse the cached prefix, run the rest, compare with a full recompute, store the KV."""
    from cluster.serving.model import continue_from, prefill

    tokens = prompt.tokens
    full_ms, (ref_logits, ref_kv) = _best_ms(lambda: prefill(model, tokens))
    tiers = _hit_tiers(client, tokens)
    start_s = time.perf_counter()
    cached_tokens, kv_prefix = client.get(tokens)
    fetch_ms = (time.perf_counter() - start_s) * 1e3
    hits = {name: 0 for name in TIER_NAMES}
    for tier in tiers[: cached_tokens // PAGE_TOKENS]:
        hits[TIER_NAMES[tier]] += 1
    if cached_tokens:
        # A fully cached prompt still runs its last token, to get the next-token logits.
        kv_prefix = kv_prefix[:, :, :, : min(cached_tokens, len(tokens) - 1)]
        rest_ms, logits = _best_ms(lambda: continue_from(model, kv_prefix, tokens))
    else:
        fetch_ms, rest_ms, logits = 0.0, full_ms, ref_logits
    # The reference recompute's KV holds the whole prompt; put() skips the pages already stored.
    client.put(tokens, ref_kv)
    return PromptResult(
        prompt.name, len(tokens), cached_tokens, hits, full_ms, fetch_ms, rest_ms,
        float((logits - ref_logits).abs().max()),
        bool(logits.argmax() == ref_logits.argmax()))


def _replica_fetch(spec, tokens: list[int]) -> dict:
    """Runs on a worker node: get the shared prefix from the head node through Ray objects."""
    from cluster import connect

    client = connect(spec)
    fetch_ms = []
    with warnings.catch_warnings():
        # Ray hands back read-only arrays; the client only reads them (see fetch.py).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for _ in range(2):  # the first get also pays for the replica's first object transfer
            start_s = time.perf_counter()
            num_tokens, kv = client.get(tokens)
            fetch_ms.append((time.perf_counter() - start_s) * 1e3)
    return {"node_id": client.home.node_id, "cached_tokens": num_tokens,
            "first_fetch_ms": fetch_ms[0], "fetch_ms": fetch_ms[1],
            "remote_pages": client.counters["remote_pages"] // 2, "kv": kv}


def remote_replica(spec, tokens: list[int], node_id: str, local_kv: torch.Tensor) -> dict:
    """A replica on another node reuses the system prompt the driver stored."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=1, max_retries=0)(_replica_fetch).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))
    result = ray.get(task.remote(spec, tokens))
    kv = result.pop("kv")
    n = result["cached_tokens"]
    result["max_kv_diff"] = float((kv - local_kv[:, :, :, :n]).abs().max()) if n else 0.0
    return result


# ---- reporting ------------------------------------------------------------------------------


def _table(title: str, columns: tuple[str, ...]):
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1))
    for column in columns:
        table.add_column(column, justify="right")
    table.columns[0].justify = "left"
    return table


def _prompt_table(results: list[PromptResult]):
    table = _table(f"Prefill with and without raykv ({MODEL_PRESET}, random weights, CPU)",
                   ("prompt", "tokens", "cached", "hits\ndev/host/disk", "no cache\nms",
                    "fetch\nms", "rest\nms",
                    "cached\nms", "speed\nup", "max\n|dlogit|", "top-1\nsame"))
    for r in results:
        hits = "/".join(str(r.hits_by_tier[name]) for name in TIER_NAMES)
        table.add_row(r.name, str(r.num_tokens), str(r.cached_tokens), hits,
                      f"{r.full_ms:.2f}", f"{r.fetch_ms:.2f}", f"{r.rest_ms:.2f}",
                      f"{r.cached_ms:.2f}", f"{r.speedup:.2f}x", f"{r.max_logit_diff:.1e}",
                      "yes" if r.top1_match else "[red]NO[/red]")
    return table


def tier_figures(hits: dict[str, int], node: dict, spec) -> dict[str, dict[str, int]]:
    """Per tier: page hits, pages held, their bytes as KV, and the bytes the tier stores.

    The node reports KV bytes (pages x page bytes); disk pages are stored int8-encoded, so
    their stored payload is smaller (each disk slot also has a 4 KiB header, not counted).
    """
    from cluster.core.quant import payload_bytes

    shape = spec.page_shape(PAGE_TOKENS)
    stored_page_bytes = {"device": math.prod(shape) * spec.torch_dtype().itemsize,
                         "host": math.prod(shape) * spec.torch_dtype().itemsize,
                         "disk": payload_bytes(shape, spec.torch_dtype(), DISK_CODEC)}
    return {name: {"hits": hits[name], "pages": node["pages"][name],
                   "kv_bytes": node["bytes"][name],
                   "stored_bytes": node["pages"][name] * stored_page_bytes[name]}
            for name in TIER_NAMES}


def _tier_table(tiers: dict[str, dict[str, int]], node_hits_pages: int):
    table = _table("Head node: hits and bytes by tier",
                   ("tier", "hits (pages)", "pages held", "KV bytes", "stored bytes"))
    for name, row in tiers.items():
        table.add_row(name, str(row["hits"]), str(row["pages"]), f"{row['kv_bytes']:,}",
                      f"{row['stored_bytes']:,}" + (f" ({DISK_CODEC})" if name == "disk" else ""))
    totals = {key: sum(row[key] for row in tiers.values()) for key in next(iter(tiers.values()))}
    table.add_row("[bold]total[/bold]", f"{totals['hits']} (node: {node_hits_pages})",
                  str(totals["pages"]), f"{totals['kv_bytes']:,}", f"{totals['stored_bytes']:,}")
    return table


def _quant_table(report: list[dict], num_tokens: int):
    table = _table(f"Disk codecs on the model's real KV ({num_tokens} tokens)",
                   ("codec", "bytes before", "bytes after", "saved", "max |err|", "rel rms err"))
    for row in report:
        table.add_row(row["codec"], f"{row['bytes_before']:,}", f"{row['bytes_after']:,}",
                      f"{row['bytes_saved_ratio']:.1%}", f"{row['max_abs_err']:.2e}",
                      f"{row['rel_rms_err']:.2e}")
    return table


def _plot_prefill(axes, results: list[PromptResult]) -> None:
    xs = range(len(results))
    axes.bar([x - 0.2 for x in xs], [r.full_ms for r in results], 0.4, label="no cache")
    axes.bar([x + 0.2 for x in xs], [r.rest_ms for r in results], 0.4, label="with cache: rest")
    axes.bar([x + 0.2 for x in xs], [r.fetch_ms for r in results], 0.4,
             bottom=[r.rest_ms for r in results], label="with cache: fetch")
    for x, r in zip(xs, results, strict=True):
        axes.annotate(f"{r.cached_tokens}/{r.num_tokens} cached\n{r.speedup:.2f}x",
                      (x + 0.2, r.cached_ms), ha="center", va="bottom", fontsize=7)
    axes.set_xticks(list(xs), [r.name for r in results], rotation=20, fontsize=8)
    axes.set_ylabel("prefill time (ms)")
    axes.set_title("Prefill per prompt: full recompute vs raykv prefix reuse")
    axes.legend(fontsize=8, loc="upper left")
    axes.margins(y=0.15)


def _plot_tiers(axes, tiers: dict[str, dict[str, int]]) -> None:
    xs = range(len(TIER_NAMES))
    axes.bar([x - 0.2 for x in xs], [tiers[n]["kv_bytes"] / 1024 for n in TIER_NAMES],
             0.4, label="KV (float32)", color="tab:blue")
    bars = axes.bar([x + 0.2 for x in xs], [tiers[n]["stored_bytes"] / 1024 for n in TIER_NAMES],
                    0.4, label=f"stored (disk: {DISK_CODEC})", color="tab:gray")
    for bar, name in zip(bars, TIER_NAMES, strict=True):
        axes.annotate(f"{tiers[name]['pages']} pages\n{tiers[name]['hits']} hits",
                      (bar.get_x(), max(tiers[name]["kv_bytes"] / 1024, bar.get_height())),
                      ha="center", va="bottom", fontsize=8)
    axes.set_xticks(list(xs), TIER_NAMES)
    axes.legend(fontsize=8)
    axes.set_ylabel("KiB held")
    axes.margins(y=0.15)
    axes.set_title("Head node: bytes per tier (page hits)")


def write_png(png_path: Path, results: list[PromptResult],
              tiers: dict[str, dict[str, int]]) -> None:
    """Two panels: prefill time with vs without the cache per prompt; bytes per tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5),
                                      gridspec_kw={"width_ratios": [2, 1]})
    _plot_prefill(left, results)
    _plot_tiers(right, tiers)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------------------


def _start_cluster(num_nodes: int):
    import logging

    import ray
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": 1, "resources": {"kv_node": 1},
                 "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**node_args, "include_dashboard": False})
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**node_args)
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def cache_config(disk_dir: str):
    from cluster import CacheConfig, ModelSpec
    from cluster.core.geometry import PageGeometry
    from cluster.core.tiers.disk import HEADER_BYTES

    geometry = PageGeometry.of(ModelSpec.preset(MODEL_PRESET), PAGE_TOKENS)
    return CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=DEVICE_PAGES * geometry.slot_bytes,
                       host_bytes=HOST_PAGES * geometry.slot_bytes,
                       disk_bytes=DISK_PAGES * (HEADER_BYTES + geometry.slot_bytes),
                       disk_dir=disk_dir, disk_codec=DISK_CODEC)


def _round_trip_ms(client, repeats: int = 20) -> float:
    """Best time of one ray.get round trip to the head node actor (a stats call)."""
    import ray

    return _best_ms(lambda: ray.get(client.home.stats()), repeats)[0]


def _summary(results: list[PromptResult], round_trip_ms: float) -> str:
    reused = [r for r in results if r.cached_tokens]
    if not reused:
        return "No prompt reused a cached prefix."
    skipped = sum(r.cached_tokens for r in reused) / sum(r.num_tokens for r in reused)
    full_ms = sum(r.full_ms for r in reused)
    rest_ms = sum(r.rest_ms for r in reused)
    fetch_ms = sum(r.fetch_ms for r in reused)
    total_ms = rest_ms + fetch_ms
    return (f"Prompts with a cached prefix skipped {skipped:.0%} of their prefill tokens: "
            f"{full_ms:.1f} ms of prefill became {rest_ms:.1f} ms of model time plus "
            f"{fetch_ms:.1f} ms of fetches, {full_ms / max(total_ms, 1e-9):.2f}x overall "
            f"(one node-actor round trip: {round_trip_ms:.2f} ms)." + _accuracy_note(results))


def _accuracy_note(results: list[PromptResult]) -> str:
    from_disk = [r.max_logit_diff for r in results if r.hits_by_tier["disk"]]
    in_memory = [r.max_logit_diff for r in results if not r.hits_by_tier["disk"]]
    if not from_disk:
        return ""
    return (f" Prefixes with pages read back from disk ({DISK_CODEC}) differ by up to "
            f"{max(from_disk):.1e} in logits, the others by up to {max(in_memory, default=0):.1e}.")


def _print_replica(console, replica: dict) -> None:
    console.print(f"Replica on node {replica['node_id'][:8]} reused the system prompt stored on "
                  f"the head node: {replica['cached_tokens']} tokens, {replica['remote_pages']} "
                  f"pages through Ray objects in {replica['fetch_ms']:.1f} ms "
                  f"({replica['first_fetch_ms']:.1f} ms the first time), max |KV diff| "
                  f"{replica['max_kv_diff']:.1e}")


def _serve_all(client, model, prompts: list[Prompt]) -> list[PromptResult]:
    from cluster.serving.model import continue_from, prefill

    for _ in range(TIMING_REPEATS):  # warm-up: the first forwards pay one-off costs
        _, kv = prefill(model, prompts[0].tokens)
        continue_from(model, kv[:, :, :, :SYSTEM_TOKENS], prompts[0].tokens)
    return [serve_prompt(client, model, prompt) for prompt in prompts]


def _workload_run(console, num_nodes: int) -> dict:
    import ray

    from cluster import connect
    from cluster.core.quant import quant_report
    from cluster.serving.model import build_llama, prefill

    model, spec = build_llama(MODEL_PRESET, seed=0)
    prompts = make_workload(seed=0)
    client = connect(spec)
    results = _serve_all(client, model, prompts)
    stats = client.stats()
    hits = {name: sum(r.hits_by_tier[name] for r in results) for name in TIER_NAMES}
    longest = max(prompts, key=lambda p: len(p.tokens))
    _, kv = prefill(model, longest.tokens)
    report = quant_report(kv, PAGE_TOKENS)
    console.print(_prompt_table(results))
    console.print(_summary(results, _round_trip_ms(client)))
    tiers = tier_figures(hits, stats["node"], spec)
    console.print(_tier_table(tiers, stats["node"]["hits_pages"]))
    console.print(_quant_table(report, len(longest.tokens)))
    others = [n["NodeID"] for n in ray.nodes()
              if n["Alive"] and n["NodeID"] != client.home.node_id]
    replica = None
    if num_nodes > 1 and others:
        replica = remote_replica(spec, prompts[0].tokens[:SYSTEM_TOKENS], others[0], kv)
        _print_replica(console, replica)
    return {"prompts": [{**asdict(r), "cached_ms": r.cached_ms, "speedup": r.speedup}
                        for r in results],
            "tiers": tiers, "node": stats["node"], "directory": stats["directory"],
            "quant": report, "replica": replica, "results": results}


def _shutdown(cluster) -> None:
    """Stop raykv (its node actors unlink their shared memory) and the simulated cluster."""
    import ray

    from cluster import stop

    try:
        if ray.is_initialized():
            stop()
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_demo(png_path: Path, num_nodes: int) -> dict:
    """Start a simulated cluster and raykv, run the workload, print tables, write the PNG."""
    from rich.console import Console

    from cluster import start

    if num_nodes < 1:
        raise ValueError(f"num_nodes must be at least 1, got {num_nodes}")
    console = Console(width=max(Console().width, 120))
    start_s = time.perf_counter()
    disk_dir = tempfile.mkdtemp(prefix="raykv-demo-", dir="/tmp")
    config = cache_config(disk_dir)
    cluster = None
    num_threads = torch.get_num_threads()
    # One thread: small matmuls gain little from more, and lose much when Ray wants the cores.
    torch.set_num_threads(1)
    try:
        cluster = _start_cluster(num_nodes)
        started = start(config)
        console.print(f"raykv running on {len(started['nodes'])} nodes "
                      f"({time.perf_counter() - start_s:.1f} s to start)")
        figures = _workload_run(console, num_nodes)
        write_png(Path(png_path), figures.pop("results"), figures["tiers"])
    finally:
        if cluster is not None:
            _shutdown(cluster)
        shutil.rmtree(disk_dir, ignore_errors=True)
        torch.set_num_threads(num_threads)
    figures["png"] = str(png_path)
    figures["elapsed_s"] = time.perf_counter() - start_s
    console.print(f"Chart written to {png_path}; demo took {figures['elapsed_s']:.1f} s")
    return figures
