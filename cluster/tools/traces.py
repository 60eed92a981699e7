"""Spiky request traces: generated, saved and loaded as Parquet (pyarrow).

A trace is a list of requests in arrival order. Each asks for a shared prefix (a system
prompt, a document: Zipf-distributed popularity) followed by its own unique suffix, for one
model and tenant, and arrives at one node (where a KV-aware router would send it):

    arrivals   Poisson at `base_rate_per_s`; every `spike_every_s` a spike of `spike_s` whose
               extra traffic ramps over `ramp_s` up to `spike_factor` x the base rate and goes
               to `num_spike_prefixes` prefixes among the `spike_ranks` most popular (an
               app whose traffic surges: its prompts were warm, now they are hot)
    node       the prefix's home node (affinity, as a prefix-aware router keeps it) unless
               that node already received `node_capacity_per_s` in the last second: then the
               node that received the fewest (the router's overflow)
    tokens     prefix tokens are a function of (model, prefix_id); suffix tokens of the
               request id: a replay regenerates them (prompt_tokens), the file stays small
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import deque
from dataclasses import astuple, dataclass, fields

import numpy as np

VOCAB = 32000
SUFFIX_SEED = 1 << 40


@dataclass(frozen=True, slots=True)
class TraceShape:
    duration_s: float = 60.0
    base_rate_per_s: float = 6.0
    spike_factor: float = 10.0
    spike_every_s: float = 20.0
    spike_s: float = 8.0
    ramp_s: float = 3.0
    first_spike_s: float = 10.0
    num_prefixes: int = 120
    num_spike_prefixes: int = 2
    spike_ranks: int = 10
    zipf_s: float = 1.1
    prefix_pages: tuple[int, int] = (2, 8)
    suffix_tokens: int = 24
    page_tokens: int = 64
    models: tuple[str, ...] = ("small-llama", "tiny-llama")
    tenants: tuple[str, ...] = ("default",)
    num_nodes: int = 3
    node_capacity_per_s: float = 12.0
    high_priority_share: float = 0.1
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    model: str
    tenant: str
    prefix_id: int
    prefix_tokens: int
    suffix_tokens: int
    node: int
    priority: str
    spike: bool


def spike_index(shape: TraceShape, t_s: float) -> int | None:
    """Which spike `t_s` falls in (0, 1, ...), or None between spikes."""
    into_s = t_s - shape.first_spike_s
    if into_s < 0 or into_s % shape.spike_every_s >= shape.spike_s:
        return None
    return int(into_s // shape.spike_every_s)


def spike_factor_at(shape: TraceShape, t_s: float) -> float:
    """The arrival rate at `t_s` as a multiple of the base rate: 1 outside spikes, ramping to
    `spike_factor` over `ramp_s` inside one."""
    if spike_index(shape, t_s) is None:
        return 1.0
    into_s = (t_s - shape.first_spike_s) % shape.spike_every_s
    ramp = min(1.0, into_s / shape.ramp_s) if shape.ramp_s > 0 else 1.0
    return 1.0 + ramp * (shape.spike_factor - 1.0)


def arrivals(shape: TraceShape, rng: random.Random) -> list[tuple[float, bool]]:
    """(time, in a spike's extra traffic) of each arrival: a thinned Poisson process."""
    peak_per_s = shape.base_rate_per_s * shape.spike_factor
    out, t_s = [], 0.0
    while True:
        t_s += rng.expovariate(peak_per_s)
        if t_s >= shape.duration_s:
            return out
        factor = spike_factor_at(shape, t_s)
        draw = rng.random() * shape.spike_factor
        if draw < factor:
            out.append((t_s, draw >= 1.0))


def _prefix_tokens(shape: TraceShape, rng: random.Random) -> list[int]:
    low, high = shape.prefix_pages
    return [rng.randint(low, high) * shape.page_tokens for _ in range(shape.num_prefixes)]


class _Router:
    """Home node by prefix, overflow to the least-loaded node past the per-node capacity."""

    def __init__(self, shape: TraceShape):
        self.shape = shape
        self.recent: list[deque[float]] = [deque() for _ in range(shape.num_nodes)]

    def place(self, prefix_id: int, t_s: float) -> int:
        for window in self.recent:
            while window and window[0] <= t_s - 1.0:
                window.popleft()
        home = prefix_id % self.shape.num_nodes
        node = home
        if len(self.recent[home]) >= self.shape.node_capacity_per_s:
            node = min(range(self.shape.num_nodes), key=lambda n: (len(self.recent[n]), n))
        self.recent[node].append(t_s)
        return node


def make_trace(shape: TraceShape) -> list[TraceRequest]:
    """A trace of `shape` (the same shape and seed give the same trace)."""
    rng = random.Random(shape.seed)
    lengths = _prefix_tokens(shape, rng)
    weights = [1.0 / (rank + 1) ** shape.zipf_s for rank in range(shape.num_prefixes)]
    cumulative = list(np.cumsum(weights))
    head = list(range(min(shape.spike_ranks, shape.num_prefixes)))
    num_spikes = math.ceil(shape.duration_s / shape.spike_every_s) + 1
    spike_sets = [rng.sample(head, shape.num_spike_prefixes) for _ in range(num_spikes)]
    router = _Router(shape)
    trace = []
    for request_id, (t_s, extra) in enumerate(arrivals(shape, rng)):
        if extra:
            prefix_id = rng.choice(spike_sets[spike_index(shape, t_s)])
        else:
            prefix_id = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        priority = "high" if rng.random() < shape.high_priority_share else "normal"
        trace.append(TraceRequest(
            request_id, t_s, shape.models[prefix_id % len(shape.models)],
            shape.tenants[(prefix_id // len(shape.models)) % len(shape.tenants)], prefix_id,
            lengths[prefix_id], shape.suffix_tokens, router.place(prefix_id, t_s), priority,
            extra))
    return trace


def prompt_tokens(request: TraceRequest) -> list[int]:
    """The request's prompt: its prefix's tokens (shared), then its own suffix."""
    name = f"{request.model}/{request.prefix_id}".encode()
    seed = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")
    prefix = np.random.default_rng(seed).integers(0, VOCAB, request.prefix_tokens)
    suffix = np.random.default_rng(SUFFIX_SEED + request.request_id).integers(
        0, VOCAB, request.suffix_tokens)
    return np.concatenate([prefix, suffix]).tolist()


# ---- Parquet ----------------------------------------------------------------------------------


def to_table(trace: list[TraceRequest]):
    import pyarrow as pa

    names = [f.name for f in fields(TraceRequest)]
    columns = list(zip(*(astuple(r) for r in trace), strict=True)) if trace else [[]] * len(names)
    return pa.table({name: list(column) for name, column in zip(names, columns, strict=True)})


def save_trace(trace: list[TraceRequest], path: str) -> None:
    """Write a trace as a Parquet file (one row per request)."""
    import pyarrow.parquet as pq

    pq.write_table(to_table(trace), path)


def load_trace(path: str) -> list[TraceRequest]:
    """Read a trace written by save_trace."""
    import pyarrow.parquet as pq

    columns = pq.read_table(path).to_pydict()
    names = [f.name for f in fields(TraceRequest)]
    return [TraceRequest(*row) for row in zip(*(columns[n] for n in names), strict=True)]
