"""Admission under bursts: per-tenant token buckets, priority classes, bounded queues.

Pure: no clock, no asyncio. The serving layer (cluster/serving/admission.py) passes `now_s`,
awaits queued tickets with a timeout, and turns a Reject into HTTP 429 with Retry-After.

    arrive(tenant, priority, now_s)
        tenant's bucket empty ------------------> Reject("rate_limited", retry after a token)
        a slot free ----------------------------> Admit(ticket)
        its class's queue has room -------------> Queued(ticket)   (the caller waits, bounded)
        otherwise -------------------------------> Reject("overloaded", retry after the queue)
    finish(ticket, now_s) -> the next ticket to run (highest class first, FIFO in a class)
    cancel(ticket)        -> a queued ticket gave up (its wait timed out, its client left)

Invariant: a ticket waits only while every slot is taken; finish() hands a freed slot to the
first waiter, so nobody waits behind a free slot.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PRIORITIES = {"high": 0, "normal": 1, "low": 2}  # class name -> rank (0 runs first)
RATE_LIMITED, OVERLOADED = "rate_limited", "overloaded"
SERVICE_EWMA_WEIGHT = 0.2  # weight of the newest request in the mean service time


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's bucket (requests per second, refilled continuously), default class, and
    the most urgent class its requests may ask for (a higher one is lowered to it)."""

    rate_per_s: float = math.inf
    burst: float = math.inf  # the bucket's size: requests a tenant may send at once
    priority: str = "normal"
    max_priority: str = "high"


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The gate's settings. `max_queued` bounds each priority class's queue."""

    max_in_flight: int = 64
    max_queued: int = 64
    max_wait_s: float = 10.0
    tenants: dict[str, TenantLimits] = field(default_factory=dict)
    default: TenantLimits = TenantLimits()

    def tenant(self, name: str) -> TenantLimits:
        return self.tenants.get(name, self.default)


@dataclass(frozen=True, slots=True)
class Bucket:
    tokens: float
    updated_s: float


@dataclass(frozen=True, slots=True)
class Ticket:
    ticket_id: int
    tenant: str
    rank: int  # PRIORITIES value
    arrived_s: float


@dataclass(frozen=True, slots=True)
class Admit:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Queued:
    ticket: Ticket
    deadline_s: float  # past it the caller gives up: Reject("overloaded")


@dataclass(frozen=True, slots=True)
class Reject:
    code: str  # RATE_LIMITED or OVERLOADED
    retry_after_s: float
    message: str


Decision = Admit | Queued | Reject


def take_token(bucket: Bucket | None, limits: TenantLimits, now_s: float,
               cost: float = 1.0) -> tuple[float, Bucket]:
    """(seconds until `cost` tokens are there: 0 when taken now, the bucket after)."""
    if bucket is None:
        bucket = Bucket(limits.burst, now_s)
    elapsed_s = max(0.0, now_s - bucket.updated_s)
    tokens = min(limits.burst, bucket.tokens + elapsed_s * limits.rate_per_s)
    if tokens >= cost:
        return 0.0, Bucket(tokens - cost, now_s)
    wait_s = (cost - tokens) / limits.rate_per_s if limits.rate_per_s > 0 else math.inf
    return wait_s, Bucket(tokens, now_s)


def priority_rank(name: str) -> int:
    """The rank of a priority class name; ValueError naming the known ones."""
    rank = PRIORITIES.get(name)
    if rank is None:
        raise ValueError(f"unknown priority {name!r}; expected one of {list(PRIORITIES)}")
    return rank


class AdmissionQueue:
    """Token buckets, in-flight slots and per-class queues of one gate (see module doc)."""

    def __init__(self, limits: AdmissionLimits):
        assert limits.max_in_flight >= 1, "max_in_flight must be at least 1"
        self.limits = limits
        self.buckets: dict[str, Bucket] = {}
        self.waiting: list[deque[Ticket]] = [deque() for _ in PRIORITIES]
        self.in_flight = 0
        self.service_s = 0.0  # mean time a request holds its slot (EWMA)
        self.started_s: dict[int, float] = {}
        self._next_id = 0
        self.counters = {"admitted": 0, "queued": 0, RATE_LIMITED: 0, OVERLOADED: 0,
                         "timed_out": 0}

    def arrive(self, tenant: str, priority: str | None, now_s: float) -> Decision:
        """Decide one request; `priority` None takes the tenant's default class."""
        limits = self.limits.tenant(tenant)
        # The header is the caller's, the ceiling the operator's: no tenant jumps its class.
        rank = max(priority_rank(priority or limits.priority),
                   priority_rank(limits.max_priority))
        wait_s, self.buckets[tenant] = take_token(self.buckets.get(tenant), limits, now_s)
        if wait_s > 0:
            self.counters[RATE_LIMITED] += 1
            return Reject(RATE_LIMITED, wait_s, f"tenant {tenant!r} is over its rate of "
                          f"{limits.rate_per_s:g} requests/s")
        self._next_id += 1
        ticket = Ticket(self._next_id, tenant, rank, now_s)
        if self.in_flight < self.limits.max_in_flight:
            return self._admit(ticket, now_s)
        queue = self.waiting[rank]
        if len(queue) >= self.limits.max_queued:
            self.counters[OVERLOADED] += 1
            return Reject(OVERLOADED, self.retry_after_s(rank),
                          f"the {priority or limits.priority} queue is full "
                          f"({self.limits.max_queued} waiting)")
        queue.append(ticket)
        self.counters["queued"] += 1
        return Queued(ticket, now_s + self.limits.max_wait_s)

    def _admit(self, ticket: Ticket, now_s: float) -> Admit:
        self.in_flight += 1
        self.started_s[ticket.ticket_id] = now_s
        self.counters["admitted"] += 1
        return Admit(ticket)

    def finish(self, ticket: Ticket, now_s: float) -> Ticket | None:
        """Free an admitted ticket's slot; returns the waiter admitted into it, if any."""
        started_s = self.started_s.pop(ticket.ticket_id, None)
        if started_s is None:
            return None  # not admitted, or finished already
        self.in_flight -= 1
        held_s = now_s - started_s
        self.service_s += SERVICE_EWMA_WEIGHT * (held_s - self.service_s)
        for queue in self.waiting:
            if queue:
                return self._admit(queue.popleft(), now_s).ticket
        return None

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a queued ticket (its wait ended); False when it is not waiting."""
        queue = self.waiting[ticket.rank]
        if ticket in queue:
            queue.remove(ticket)
            self.counters["timed_out"] += 1
            return True
        return False

    def retry_after_s(self, rank: int) -> float:
        """A guess at when a request of class `rank` would find room: the waiters at or above
        it, served `max_in_flight` at a time at the mean service time (at least 1 s)."""
        ahead = sum(len(q) for q in self.waiting[: rank + 1]) + 1
        estimate_s = ahead * self.service_s / self.limits.max_in_flight
        return min(max(1.0, estimate_s), max(1.0, self.limits.max_wait_s))

    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting)

    def stats(self) -> dict:
        return {"in_flight": self.in_flight, "waiting": [len(q) for q in self.waiting],
                "service_ms": self.service_s * 1e3, **self.counters}

