"""`raykv bench elastic` (and the second part of `raykv bench burst`): three models of
different page sizes share one node's host memory, under the same total budget:

    elastic   one budget for all, handed out in chunks as each model needs it
    static    the strongest static split: each model's quota (min = max) in proportion to its
              working set, in whole chunks (static_split)

The workload moves between the models, as traffic does: a phase where the medium model is
busy, one where the large model is, then a mix (the small model is always a little busy). The
working sets together are larger than the budget, and a model's prompts are asked uniformly.
Each request gets its prompt's cached prefix and, on a miss, puts the prompt (as an engine that
recomputed it would). Hit ratio = cached tokens / requested tokens, after a warm-up.

Rounds (harness.interleave, at least 3, elastic and static in rotating order) each draw a
fresh trace (seed = the round) that both replay, each on a fresh service:

    elastic_vs_static_hit_ratio   median over rounds of elastic / static hit ratio   >= 1.1

Then, on one more fresh elastic service:

    idle_shrink_s          the small model fills its working set (6 MiB) and goes idle while
                           the large one runs; seconds until its memory is back in the pool
                           (not exercised if it held none or never gave it back)
    min_quota_violations   the medium model gets a min above its fair share and fills its
                           working set; the large model hammers the tier while the medium's
                           holdings are sampled: samples under its min once it had reached it
                           (not exercised unless, under the hammering, it held at most its
                           min: the min, not its fair share, decided what it kept)
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager

import numpy as np

from cluster.core.config import MiB
from cluster.tools.bench import common, harness

PAGE_TOKENS = 64
BUDGET_BYTES = 48 * MiB
CHUNK_BYTES = 4 * MiB
IDLE_SHRINK_S = 2.0
ROUNDS = 3
# name, (layers, kv heads, head dim): 32 KiB, 256 KiB and 1 MiB pages of 64 tokens
MODELS = {"small": (2, 2, 16), "medium": (4, 4, 32), "large": (8, 4, 64)}
PROMPTS = {"small": 48, "medium": 32, "large": 10}  # 4 pages each: 6, 32 and 40 MiB in all
PHASES = ({"small": 0.2, "medium": 0.8}, {"small": 0.1, "large": 0.9},
          {"small": 0.2, "medium": 0.4, "large": 0.4})  # each model's share of the requests
PAGES_PER_PROMPT = 4
# Above the medium model's fair share (half the budget against the large one): the large
# model's pressure must reach it.
MEDIUM_MIN_BYTES = 28 * MiB
GOALS = {"elastic_vs_static_hit_ratio": {"min": 1.1}, "min_quota_violations": {"max": 0}}


def specs():
    from cluster import ModelSpec

    return {name: ModelSpec(f"bench-{name}", *shape, "float32") for name, shape in MODELS.items()}


def working_set_bytes() -> dict[str, int]:
    """Bytes of every prompt of each model: what it would hold to hit on every request."""
    return {name: PROMPTS[name] * PAGES_PER_PROMPT * spec.page_bytes(PAGE_TOKENS)
            for name, spec in specs().items()}


def proportional_split(wanted_bytes: dict[str, int], budget_bytes: int,
                       chunk_bytes: int) -> dict[str, int]:
    """The budget's whole chunks shared in proportion to `wanted_bytes` (largest remainder),
    at least one chunk each (the pool hands out nothing smaller), never past a model's want
    rounded up to a chunk."""
    num_chunks = budget_bytes // chunk_bytes
    total = sum(wanted_bytes.values())
    exact = {name: num_chunks * wanted / total for name, wanted in wanted_bytes.items()}
    cap = {name: -(-wanted // chunk_bytes) for name, wanted in wanted_bytes.items()}
    chunks = {name: min(cap[name], max(1, int(share))) for name, share in exact.items()}
    # the chunks left go to those furthest under their exact share
    by_remainder = sorted(exact, key=lambda name: exact[name] - chunks[name], reverse=True)
    while sum(chunks.values()) < num_chunks and any(chunks[n] < cap[n] for n in chunks):
        for name in by_remainder:
            if sum(chunks.values()) < num_chunks and chunks[name] < cap[name]:
                chunks[name] += 1
    return {name: count * chunk_bytes for name, count in chunks.items()}


def static_quotas() -> dict[str, int]:
    return proportional_split(working_set_bytes(), BUDGET_BYTES, CHUNK_BYTES)


def config(disk_dir: str):
    from cluster import CacheConfig

    return CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=0, host_bytes=BUDGET_BYTES,
                       disk_bytes=0, disk_dir=disk_dir, chunk_bytes=CHUNK_BYTES,
                       idle_shrink_s=IDLE_SHRINK_S)


def trace(num_requests: int, seed: int = 0) -> list[tuple[str, int]]:
    """(model, prompt) requests: the phases in turn, prompts uniform within a model's set."""
    rng = np.random.default_rng(seed)
    requests = []
    for phase in PHASES:
        names = list(phase)
        for model in rng.choice(names, size=num_requests // len(PHASES),
                                p=[phase[n] for n in names]):
            requests.append((str(model), int(rng.integers(PROMPTS[str(model)]))))
    return requests


def tokens_of(model: str, prompt: int) -> list[int]:
    start = (list(MODELS).index(model) * 1000 + prompt) * 1000
    return list(range(start, start + PAGES_PER_PROMPT * PAGE_TOKENS))


class Models:
    """A client and a KV tensor per model."""

    def __init__(self):
        import torch

        from cluster import connect

        self.specs = specs()
        self.clients = {name: connect(spec) for name, spec in self.specs.items()}
        self.kv = {name: torch.zeros(spec.page_shape(PAGES_PER_PROMPT * PAGE_TOKENS))
                   for name, spec in self.specs.items()}

    def request(self, model: str, prompt: int) -> tuple[int, int]:
        """(cached tokens, requested tokens); a miss puts the prompt."""
        client, tokens = self.clients[model], tokens_of(model, prompt)
        cached, _ = client.get(tokens)
        if cached < len(tokens):
            client.put(tokens, self.kv[model])
        return cached, len(tokens)

    def held_bytes(self) -> dict[str, int]:
        models = self.clients["small"].stats()["node"]["models"]
        return {name: models.get(spec.name, 0) for name, spec in self.specs.items()}


@contextmanager
def service(mode: str):
    """A fresh service on this process's Ray (static: the proportional quotas registered),
    and the models' clients; stopped on the way out."""
    from cluster import Quota, register_model, start

    disk_dir = tempfile.mkdtemp(prefix=f"raykv-bench-elastic-{mode}-", dir="/tmp")
    try:
        common.stop_service()
        start(config(disk_dir))
        if mode == "static":
            quotas = static_quotas()
            for name, spec in specs().items():
                register_model(spec, Quota(min_bytes=quotas[name], max_bytes=quotas[name]))
        yield Models()
    finally:
        common.stop_service()
        shutil.rmtree(disk_dir, ignore_errors=True)


def replay(models: Models, requests: list[tuple[str, int]]) -> dict:
    warm = len(requests) // 10  # the start fills the caches; not counted
    per_model: dict[str, list[int]] = {name: [0, 0] for name in MODELS}
    for index, (model, prompt) in enumerate(requests):
        hit, wanted = models.request(model, prompt)
        if index >= warm:
            per_model[model][0] += hit
            per_model[model][1] += wanted
    cached, asked = (sum(c for c, _ in per_model.values()),
                     sum(a for _, a in per_model.values()))
    return {"hit_ratio": cached / max(1, asked),
            "per_model_hit_ratio": {m: c / max(1, a) for m, (c, a) in per_model.items()},
            "held_bytes": models.held_bytes()}


def idle_shrink(models: Models) -> dict:
    """The small model fills its prompts (6 MiB), then only the large model runs:
    seconds until the small model's memory is back in the pool (it has no min)."""
    for prompt in range(PROMPTS["small"]):
        models.request("small", prompt)
    held_before = models.held_bytes()["small"]
    start_s = time.monotonic()
    while models.held_bytes()["small"] > 0 and time.monotonic() - start_s < 60:
        models.request("large", int(time.monotonic() * 1000) % PROMPTS["large"])
    return {"held_before_bytes": held_before, "idle_shrink_s": time.monotonic() - start_s,
            "held_after_bytes": models.held_bytes()}


def floor_outcome(samples: list[int], pressure_from: int, floor_bytes: int) -> dict:
    """Of a model's holdings sampled as it filled and then, from sample `pressure_from`, under
    another model's pressure: violations (samples under the floor once it had held at least
    the floor) and whether the floor was reached (it had filled to the floor, and under
    pressure held at most the floor: the floor, not its fair share, decided what it kept)."""
    first = next((i for i, held in enumerate(samples) if held >= floor_bytes), None)
    if first is None:
        return {"min_quota_violations": 0, "reached": False}
    pressed = samples[max(first, pressure_from):]
    return {"min_quota_violations": sum(1 for held in samples[first:] if held < floor_bytes),
            "reached": any(held <= floor_bytes for held in pressed)}


def min_violations(models: Models, num_requests: int) -> dict:
    """The medium model gets a min and fills its working set; the large one hammers the tier;
    the medium's holdings are sampled after every request."""
    from cluster import Quota, register_model

    register_model(models.specs["medium"], Quota(min_bytes=MEDIUM_MIN_BYTES))
    samples = []
    for prompt in range(PROMPTS["medium"]):
        models.request("medium", prompt)
        samples.append(models.held_bytes()["medium"])
    for index in range(num_requests):
        models.request("large", index % PROMPTS["large"])
        samples.append(models.held_bytes()["medium"])
    return {"min_bytes": MEDIUM_MIN_BYTES, "samples": len(samples),
            "max_held_bytes": max(samples), "min_held_bytes": min(samples),
            "large_held_bytes": models.held_bytes()["large"],
            **floor_outcome(samples, PROMPTS["medium"], MEDIUM_MIN_BYTES)}


def measure(report: harness.Report, quick: bool) -> dict:
    """The rounds and the checks on the Ray this process is connected to; the ratios go into
    `report`, the figures are returned."""
    num_requests = 400 if quick else 1600
    rounds: dict[str, list[dict]] = {"elastic": [], "static": []}

    def contender(mode: str):
        def hit_ratio(round_index: int) -> float:
            with service(mode) as models:
                rounds[mode].append(replay(models, trace(num_requests, seed=round_index)))
            return rounds[mode][-1]["hit_ratio"]
        return hit_ratio

    hits = harness.interleave({mode: contender(mode) for mode in rounds}, ROUNDS)
    report.paired("elastic_vs_static_hit_ratio", hits["elastic"], hits["static"])
    with service("elastic") as models:
        idle = idle_shrink(models)
        floor = min_violations(models, num_requests // 8)
    if report.require("idle_shrink_s", idle["held_before_bytes"] > 0
                      and idle["held_after_bytes"]["small"] == 0,
                      "the idle model held nothing, or never gave its memory back"):
        report.ratio("idle_shrink_s", idle["idle_shrink_s"])
    if report.require("min_quota_violations", floor["reached"],
                      "under pressure the protected model never held as little as its min"):
        report.ratio("min_quota_violations", floor["min_quota_violations"])
    return {"rounds": rounds, "idle": idle, "min": floor,
            "hit_ratio": {mode: statistics.median(values) for mode, values in hits.items()}}


def notes(quick: bool) -> list[str]:
    quotas = " / ".join(f"{name} {num_bytes // MiB}" for name, num_bytes in
                        static_quotas().items())
    sets = " / ".join(f"{name} {num_bytes / MiB:g}" for name, num_bytes in
                      working_set_bytes().items())
    return [f"elastic: three models (32 KiB, 256 KiB and 1 MiB pages of {PAGE_TOKENS} tokens, "
            f"{PAGES_PER_PROMPT} pages a prompt; working sets {sets} MiB) in one "
            f"{BUDGET_BYTES // MiB} MiB host budget handed out in {CHUNK_BYTES // MiB} MiB "
            f"chunks; {400 if quick else 1600} requests a round over three phases, the "
            f"first tenth not counted; static = min = max per model in proportion to its "
            f"working set, in whole chunks: {quotas} MiB; {ROUNDS} rounds, each a fresh trace "
            f"(seed = round) replayed by both on fresh services, in rotating order",
            "hit ratio = cached / requested tokens; idle_shrink_s = seconds until an idle "
            f"model's chunks are back (idle_shrink_s setting {IDLE_SHRINK_S:g} s, checked "
            "each heartbeat); min_quota_violations = samples of the medium model (min "
            f"{MEDIUM_MIN_BYTES // MiB} MiB, above its fair share) under its min once it "
            "reached it, while the large model hammers the tier"]


def plot_part(part: dict, axes) -> None:
    """Hit ratio and memory per model, static split against elastic (round 1)."""
    names = list(MODELS)
    width = 0.38
    for offset, mode in ((-width / 2, "static"), (width / 2, "elastic")):
        first = part["rounds"][mode][0]
        xs = [i + offset for i in range(len(names))]
        axes[0].bar(xs, [first["per_model_hit_ratio"][n] for n in names], width, label=mode)
        axes[1].bar(xs, [first["held_bytes"][n] / MiB for n in names], width, label=mode)
    for ax, title in ((axes[0], "hit ratio per model"), (axes[1], "memory held per model (MiB)")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend()


def table(part: dict):
    rows = []
    for mode, rounds in part["rounds"].items():
        for index, figures in enumerate(rounds):
            rows.append([f"{mode}, round {index + 1}", f"{figures['hit_ratio']:.3f}",
                         " ".join(f"{m}={v / MiB:.0f}MiB"
                                  for m, v in figures["held_bytes"].items())])
    return common.table("three models, one budget", ["split", "hit ratio", "held"], rows)


def run(json_path: str | None, quick: bool) -> dict:
    report = harness.Report("elastic", "hit ratio",
                            {"budget_bytes": BUDGET_BYTES, "chunk_bytes": CHUNK_BYTES,
                             "models": MODELS, "static_quotas": static_quotas(),
                             "rounds": ROUNDS, "quick": quick},
                            GOALS, notes(quick))
    started = common.ensure_local_ray(256 * MiB)
    try:
        part = measure(report, quick)
    finally:
        if started:
            import ray

            ray.shutdown()
    common.print_tables([table(part)])
    report["elastic"] = part
    return report.finish(json_path)
