"""`raykv bench pages`'s plan, pure: the geometry scaled to the memory budget, the calls per
figure, and each ratio's per-round values from the contenders' seconds."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from cluster.core.spec import ModelSpec
from cluster.tools.bench import common, harness

FULL_SPEC = common.LLAMA_8B_KV
SMALL_REPS, LARGE_REPS, LARGE_TOKENS = 15, 5, 8192  # calls per figure: more for short calls
# Bytes the largest request is held in at once: kv, out, put's page buffers, and in the host
# tier batch 0, one put and the client's lease of free slots for the next (page_kv's source
# pool, freed, is a seventh while kv is made).
FOOTPRINT_COPIES = 7
MEMORY_FRACTION = 0.25  # of MemAvailable: the machine is shared


@dataclass(frozen=True, slots=True)
class Plan:
    spec: ModelSpec  # FULL_SPEC, its layers scaled down to fit
    page_tokens: tuple[int, ...]
    request_tokens: tuple[int, ...]
    rounds: int
    budget_bytes: int

    @property
    def max_tokens(self) -> int:
        return max(self.request_tokens)

    @property
    def layer_scale(self) -> int:
        """How many times fewer layers than Llama-3.1-8B's (1: the real geometry)."""
        return FULL_SPEC.num_layers // self.spec.num_layers


def footprint_bytes(spec: ModelSpec, max_tokens: int) -> int:
    return FOOTPRINT_COPIES * max_tokens * spec.bytes_per_token


def fit_plan(budget_bytes: int, page_tokens: tuple[int, ...], request_tokens: tuple[int, ...],
             rounds: int) -> Plan:
    """The most layers of FULL_SPEC (halving from 32) whose run fits `budget_bytes` with every
    request size; at one layer, the request sizes that fit (at least the smallest)."""
    layers = FULL_SPEC.num_layers
    while layers > 1 and footprint_bytes(_with_layers(layers), max(request_tokens)) > \
            budget_bytes:
        layers //= 2
    spec = _with_layers(layers)
    fitting = tuple(n for n in request_tokens if footprint_bytes(spec, n) <= budget_bytes)
    return Plan(spec, page_tokens, fitting or request_tokens[:1], rounds, budget_bytes)


def _with_layers(num_layers: int) -> ModelSpec:
    if num_layers == FULL_SPEC.num_layers:
        return FULL_SPEC
    return dataclasses.replace(FULL_SPEC, name=f"{FULL_SPEC.name}-{num_layers}l",
                               num_layers=num_layers)


def reps_for(num_tokens: int) -> int:
    return SMALL_REPS if num_tokens < LARGE_TOKENS else LARGE_REPS


def memory_budget_bytes() -> int:
    """MEMORY_FRACTION of the memory the kernel says is available now."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(available * MEMORY_FRACTION)


def round_values(how: str, numerators: list[float], denominators: list[float],
                 num_pages: int, memcpys: list[float] | None = None) -> list[float]:
    """Per-round values of one RATIOS entry from two contenders' per-round seconds (and
    memcpy_get's, for "excess")."""
    if how == "per_page":
        return [a / num_pages * 1e6 for a in numerators]
    if how == "excess":
        return [(a - b - m) / num_pages * 1e6
                for a, b, m in zip(numerators, denominators, memcpys, strict=True)]
    if how == "overhead":
        return [(a - b) / num_pages * 1e6 for a, b in zip(numerators, denominators, strict=True)]
    if how == "floor":
        return [(a + b) / a for a, b in zip(numerators, denominators, strict=True)]
    return harness.per_round_ratios(numerators, denominators)
