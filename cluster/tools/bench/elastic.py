"""`raykv bench elastic` (and the second part of `raykv bench burst`): three models of
different page sizes share one node's memory, under the same total budget, twice in one run:

    elastic   one host budget for all, handed out in chunks as each model needs it
    static    the same budget split equally: each model's quota is a third (min = max)

The workload moves between the models, as traffic does: a phase where the medium model is
busy, one where the large model is, then a mix (the small model is always a little busy).
Each model's working set is bigger than a third of the memory, and its prompts are asked
uniformly. Each request gets its prompt's cached prefix and, on a miss, puts the prompt (as
an engine that recomputed it would). Hit ratio = cached tokens / requested tokens, over the
whole trace after a warm-up.

Then, on the elastic service: one model goes idle and the time until its chunks are back in
the pool is measured (idle_shrink_s); and a model with a min is hammered by another while its
holdings are sampled (min_quota_violations: samples below its min once it had reached it).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

from cluster.core.config import MiB
from cluster.tools.bench import common

PAGE_TOKENS = 64
BUDGET_BYTES = 48 * MiB
IDLE_SHRINK_S = 2.0
# name, (layers, kv heads, head dim): 16 KiB, 256 KiB and 1 MiB pages of 64 tokens
MODELS = {"small": (2, 2, 16), "medium": (4, 4, 32), "large": (8, 4, 64)}
PROMPTS = {"small": 48, "medium": 32, "large": 10}  # 4 pages each: 3, 32 and 40 MiB in all
PHASES = ({"small": 0.2, "medium": 0.8}, {"small": 0.1, "large": 0.9},
          {"small": 0.2, "medium": 0.4, "large": 0.4})  # each model's share of the requests
PAGES_PER_PROMPT = 4


def specs():
    from cluster import ModelSpec

    return {name: ModelSpec(f"bench-{name}", *shape, "float32") for name, shape in MODELS.items()}


def config(disk_dir: str):
    from cluster import CacheConfig

    return CacheConfig(page_tokens=PAGE_TOKENS, device_bytes=0, host_bytes=BUDGET_BYTES,
                       disk_bytes=0, disk_dir=disk_dir, chunk_bytes=4 * MiB,
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


def replay(models: Models, requests: list[tuple[str, int]]) -> dict:
    warm = len(requests) // 10  # the start fills the caches; not counted
    cached = asked = 0
    per_model: dict[str, list[int]] = {name: [0, 0] for name in MODELS}
    for index, (model, prompt) in enumerate(requests):
        hit, wanted = models.request(model, prompt)
        if index >= warm:
            cached, asked = cached + hit, asked + wanted
            per_model[model][0] += hit
            per_model[model][1] += wanted
    return {"hit_ratio": cached / max(1, asked),
            "per_model_hit_ratio": {m: c / max(1, a) for m, (c, a) in per_model.items()},
            "held_bytes": models.held_bytes()}


def static_split() -> None:
    from cluster import Quota, register_model

    third = BUDGET_BYTES // 3
    for spec in specs().values():
        register_model(spec, Quota(min_bytes=third, max_bytes=third))


def idle_shrink(models: Models) -> dict:
    """Seconds until an idle model's memory is back in the pool (it has no min)."""
    start_s = time.monotonic()
    while models.held_bytes()["small"] > 0 and time.monotonic() - start_s < 60:
        models.request("large", int(time.monotonic() * 1000) % PROMPTS["large"])  # others go on
    return {"idle_shrink_s": time.monotonic() - start_s,
            "held_after_bytes": models.held_bytes()}


def min_violations(models: Models, num_requests: int) -> dict:
    """The medium model gets a min; the large one hammers the tier; sample the medium's
    holdings: samples under its min once it reached it are violations."""
    from cluster import Quota, register_model

    floor = BUDGET_BYTES // 4
    register_model(models.specs["medium"], Quota(min_bytes=floor))
    for prompt in range(PROMPTS["medium"]):
        models.request("medium", prompt)
    samples, reached = [], False
    for index in range(num_requests):
        models.request("large", index % PROMPTS["large"])
        held = models.held_bytes()["medium"]
        reached = reached or held >= floor
        samples.append(held)
    violations = sum(1 for held in samples if reached and held < floor)
    return {"min_bytes": floor, "samples": len(samples), "min_held_bytes": min(samples),
            "min_quota_violations": violations}


def run_part(quick: bool) -> dict:
    """Both services in turn on the Ray this process is connected to; figures and ratios."""
    from cluster import start, stop

    num_requests = 400 if quick else 1600
    requests = trace(num_requests)
    figures = {}
    for mode in ("static", "elastic"):
        disk_dir = tempfile.mkdtemp(prefix=f"raykv-bench-elastic-{mode}-", dir="/tmp")
        try:
            stop()
            start(config(disk_dir))
            if mode == "static":
                static_split()
            models = Models()
            figures[mode] = replay(models, requests)
            if mode == "elastic":
                figures["idle"] = idle_shrink(models)
                figures["min"] = min_violations(models, num_requests // 8)
        finally:
            stop()
            shutil.rmtree(disk_dir, ignore_errors=True)
    ratios = {"elastic_vs_static_hit_ratio":
              figures["elastic"]["hit_ratio"] / max(1e-9, figures["static"]["hit_ratio"]),
              "idle_shrink_s": figures["idle"]["idle_shrink_s"],
              "min_quota_violations": float(figures["min"]["min_quota_violations"])}
    return {"figures": figures, "ratios": ratios}


GOALS = {"elastic_vs_static_hit_ratio": {"min": 1.2}, "min_quota_violations": {"max": 0}}
NOTES = ("elastic: three models (16 KiB, 256 KiB and 1 MiB pages) in one 48 MiB host budget "
         "over phased traffic, elastic sharing against an equal static split (min = max = a "
         "third); hit ratio = cached / requested tokens; idle_shrink_s = seconds until an idle "
         "model's chunks are back (idle_shrink_s setting 2 s, checked each heartbeat); "
         "min_quota_violations = samples of a model under its min once it reached it.")


def burst_part(node_ids: list[str], quick: bool) -> dict:
    """The second part of `raykv bench burst` (its PARTS registry)."""
    part = run_part(quick)
    return {**part["figures"], "ratios": part["ratios"], "goals": GOALS, "notes": NOTES}


def plot_part(part: dict, axes) -> None:
    """Hit ratio and memory per model, static split against elastic."""
    names = list(MODELS)
    width = 0.38
    for offset, mode in ((-width / 2, "static"), (width / 2, "elastic")):
        xs = [i + offset for i in range(len(names))]
        axes[0].bar(xs, [part[mode]["per_model_hit_ratio"][n] for n in names], width,
                    label=mode)
        axes[1].bar(xs, [part[mode]["held_bytes"][n] / MiB for n in names], width, label=mode)
    for ax, title in ((axes[0], "hit ratio per model"), (axes[1], "memory held per model (MiB)")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend()


def run(json_path: str | None, quick: bool) -> dict:
    started = common.ensure_local_ray(256 * MiB)
    try:
        part = run_part(quick)
    finally:
        if started:
            import ray

            ray.shutdown()
    rows = [[mode, f"{part['figures'][mode]['hit_ratio']:.3f}",
             " ".join(f"{m}={v / MiB:.0f}MiB" for m, v in
                      part["figures"][mode]["held_bytes"].items())]
            for mode in ("static", "elastic")]
    common.print_tables([common.table("three models, one budget", ["split", "hit ratio",
                                                                   "held"], rows)])
    result = {"benchmark": "elastic", "config": {"budget_bytes": BUDGET_BYTES,
                                                 "models": MODELS, "quick": quick},
              "machine": common.machine_info(), **part["figures"], "ratios": part["ratios"],
              "goals": GOALS}
    return common.finish(result, json_path)
