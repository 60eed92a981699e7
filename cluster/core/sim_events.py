"""The cluster simulator's clock: arrivals, per-node engine queues, completions; and the trace
scaled to N nodes.

Each node runs one engine that prefills one request at a time, first come first served (a
prefill node of a disaggregated deployment, as in Mooncake; decode is not modelled):

    start_s  = max(arrival_s, the node's free_at_s)
    finish_s = start_s + fetch_s + prefill_s
    ttft_s   = finish_s - arrival_s     (queue wait + fetch of the cached prefix + prefill)

Completions are events: a request's pages are put on its node when its prefill ends, so a
request arriving meanwhile cannot hit them. `Clock.advance(now_s)` hands out every completion
due by `now_s`, in time order, before the next arrival is routed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cluster.core.trace_format import BlockRequest


@dataclass(slots=True)
class EngineQueue:
    """One node's engine: FIFO prefill, with the requests not yet finished (for routers)."""

    free_at_s: float = 0.0
    pending: deque = field(default_factory=deque)  # (finish_s, num_blocks, service_s), in
    # finish order
    busy_s: float = 0.0

    def expire(self, now_s: float) -> None:
        while self.pending and self.pending[0][0] <= now_s:
            self.pending.popleft()

    def queue_len(self, now_s: float) -> int:
        """Requests queued or running at `now_s`."""
        self.expire(now_s)
        return len(self.pending)

    def active_blocks(self, now_s: float) -> int:
        """Blocks of the requests queued or running (Dynamo's load figure)."""
        self.expire(now_s)
        return sum(blocks for _, blocks, _ in self.pending)

    def queued_service_s(self, now_s: float) -> float:
        """The service times of the requests queued or running, each counted whole (the
        Mooncake-like router's queue estimate: what it predicted each would take)."""
        self.expire(now_s)
        return sum(service_s for _, _, service_s in self.pending)

    def wait_s(self, now_s: float) -> float:
        return max(0.0, self.free_at_s - now_s)

    def admit(self, arrival_s: float, service_s: float, num_blocks: int) -> tuple[float, float]:
        """Queue a request; (start_s, finish_s)."""
        start_s = max(arrival_s, self.free_at_s)
        finish_s = start_s + service_s
        self.free_at_s = finish_s
        self.busy_s += service_s
        self.pending.append((finish_s, num_blocks, service_s))
        return start_s, finish_s


class Clock:
    """Completion events in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = 0

    def schedule(self, at_s: float, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_s, self._seq, payload))

    def advance(self, now_s: float) -> list:
        """Payloads of the events due by `now_s`, earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now_s:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def drain(self) -> list:
        return self.advance(float("inf"))


def num_copies(num_nodes: int, nodes_per_copy: int) -> int:
    """Copies of the trace that keep the load per node constant: one per `nodes_per_copy`."""
    if num_nodes % nodes_per_copy:
        raise ValueError(f"{num_nodes} nodes is not a multiple of {nodes_per_copy}")
    return num_nodes // nodes_per_copy


def scale_trace(requests: Sequence[BlockRequest], copies: int, seed: int = 0,
                jitter_ms: float = 60_000.0, until_ms: float | None = None
                ) -> list[BlockRequest]:
    """`copies` copies of the trace, merged by arrival: copy k's block ids are shifted past
    every id of copies before it (fresh sessions that share nothing with the others), and its
    clock by a seeded offset in [0, jitter_ms) so that copies do not arrive in lockstep.
    Copy 0 is the trace itself. `until_ms`: only the arrivals before it."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    span = 1 + max((b for r in requests for b in r.block_ids), default=0)
    rng = random.Random(seed)
    until_ms = math.inf if until_ms is None else until_ms
    out: list[BlockRequest] = [r for r in requests if r.timestamp_ms < until_ms]
    for copy in range(1, copies):
        offset_ms = rng.uniform(0.0, jitter_ms)
        out.extend(replace(r, timestamp_ms=r.timestamp_ms + offset_ms,
                           block_ids=tuple(b + copy * span for b in r.block_ids))
                   for r in requests if r.timestamp_ms + offset_ms < until_ms)
    out.sort(key=lambda r: r.timestamp_ms)  # stable: equal times keep copy order
    return out
