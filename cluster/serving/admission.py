"""The admission gate of the ingress: policies/admission.py's decisions on the event loop.

    ticket = await gate.enter(tenant, priority)   # Overloaded (-> HTTP 429) or a slot
    ...the request runs...
    gate.leave(ticket)                             # the slot goes to the next waiter

A queued request waits at most `max_wait_s`; a client that goes away while waiting leaves
the queue. Every decision happens on the loop's thread, so the pure queue needs no lock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from policies.admission import AdmissionLimits, AdmissionQueue, Admit, Queued, Reject, Ticket


class Overloaded(Exception):
    """A request refused at admission: `code` is "rate_limited" or "overloaded"."""

    def __init__(self, message: str, code: str, retry_after_s: float):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1 (HTTP's Retry-After)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class AdmissionGate:
    """Slots and bounded queues for one ingress replica."""

    def __init__(self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic):
        self.queue = AdmissionQueue(limits)
        self.clock = clock
        self._waiters: dict[int, asyncio.Future] = {}

    async def enter(self, tenant: str, priority: str | None) -> Ticket:
        """A slot for one request; Overloaded when refused or when the wait runs out.

        ValueError for an unknown priority class.
        """
        decision = self.queue.arrive(tenant, priority, self.clock())
        if isinstance(decision, Admit):
            return decision.ticket
        if isinstance(decision, Reject):
            raise Overloaded(decision.message, decision.code, decision.retry_after_s)
        return await self._wait(decision)

    async def _wait(self, queued: Queued) -> Ticket:
        """Until finish() hands this ticket a slot, or its deadline passes."""
        ticket = queued.ticket
        future = asyncio.get_running_loop().create_future()
        self._waiters[ticket.ticket_id] = future
        try:
            await asyncio.wait({future}, timeout=max(0.0, queued.deadline_s - self.clock()))
        except BaseException:  # our caller went away (cancelled)
            self._waiters.pop(ticket.ticket_id, None)
            if future.done():
                self.leave(ticket)  # it was handed a slot just now: pass the slot on
            else:
                self.queue.cancel(ticket)
            raise
        self._waiters.pop(ticket.ticket_id, None)
        if not future.done():
            self.queue.cancel(ticket)
            raise Overloaded(f"no capacity within {self.queue.limits.max_wait_s:g} s",
                             "overloaded", self.queue.retry_after_s(ticket.rank))
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """End an admitted request (idempotent); its slot goes to the next waiter."""
        successor = self.queue.finish(ticket, self.clock())
        if successor is not None:
            future = self._waiters.get(successor.ticket_id)
            if future is not None and not future.done():
                future.set_result(None)

    def stats(self) -> dict:
        return self.queue.stats()
