"""Admission: token buckets, priority classes and bounded queues (pure), and the asyncio gate
of the ingress (no Ray): a full queue or a long wait is Overloaded, never a hang."""

from __future__ import annotations

import asyncio
import math

import pytest

from cluster.serving.admission import AdmissionGate, Overloaded
from policies.admission import (
    OVERLOADED,
    RATE_LIMITED,
    AdmissionLimits,
    AdmissionQueue,
    Admit,
    Bucket,
    Queued,
    Reject,
    TenantLimits,
    take_token,
)


def test_bucket_spends_its_burst_then_refills_at_its_rate():
    limits = TenantLimits(rate_per_s=2.0, burst=3.0)
    bucket = None
    for _ in range(3):
        wait_s, bucket = take_token(bucket, limits, 10.0)
        assert wait_s == 0.0
    wait_s, bucket = take_token(bucket, limits, 10.0)
    assert wait_s == pytest.approx(0.5) and bucket == Bucket(0.0, 10.0)
    wait_s, bucket = take_token(bucket, limits, 10.5)  # one token back after 1/rate s
    assert wait_s == 0.0 and bucket.tokens == pytest.approx(0.0)
    wait_s, bucket = take_token(bucket, limits, 100.0)  # never above the burst
    assert wait_s == 0.0 and bucket.tokens == pytest.approx(2.0)


def test_unlimited_tenant_never_waits():
    bucket = None
    for _ in range(1000):
        wait_s, bucket = take_token(bucket, TenantLimits(), 0.0)
        assert wait_s == 0.0


def test_a_tenant_over_its_rate_is_rate_limited_with_the_time_to_a_token():
    limits = AdmissionLimits(max_in_flight=10, tenants={"acme": TenantLimits(1.0, 1.0)})
    queue = AdmissionQueue(limits)
    assert isinstance(queue.arrive("acme", None, 0.0), Admit)
    refused = queue.arrive("acme", None, 0.25)
    assert refused == Reject(RATE_LIMITED, 0.75, refused.message)
    assert "acme" in refused.message
    assert isinstance(queue.arrive("other", None, 0.25), Admit)  # buckets are per tenant
    assert isinstance(queue.arrive("acme", None, 1.0), Admit)


def test_full_slots_queue_by_class_and_hand_over_highest_first():
    queue = AdmissionQueue(AdmissionLimits(max_in_flight=1, max_queued=2))
    running = queue.arrive("t", "normal", 0.0)
    assert isinstance(running, Admit)
    low = queue.arrive("t", "low", 0.1)
    normal = queue.arrive("t", "normal", 0.2)
    high = queue.arrive("t", "high", 0.3)
    assert [type(d) for d in (low, normal, high)] == [Queued] * 3
    assert low.deadline_s == pytest.approx(0.1 + 10.0)
    assert queue.finish(running.ticket, 1.0) == high.ticket
    assert queue.finish(high.ticket, 2.0) == normal.ticket
    assert queue.finish(normal.ticket, 3.0) == low.ticket
    assert queue.finish(low.ticket, 4.0) is None
    assert queue.in_flight == 0 and queue.num_waiting() == 0
    assert queue.finish(low.ticket, 5.0) is None  # finishing twice changes nothing
    assert queue.in_flight == 0


def test_a_full_class_queue_is_overloaded_with_a_retry_after():
    queue = AdmissionQueue(AdmissionLimits(max_in_flight=1, max_queued=1, max_wait_s=30.0))
    first = queue.arrive("t", None, 0.0).ticket
    queue.finish(first, 4.0)  # one request held its slot 4 s: the mean moves toward it
    assert queue.service_s == pytest.approx(0.8)
    queue.arrive("t", None, 4.0)
    assert isinstance(queue.arrive("t", "low", 4.0), Queued)  # low has its own queue
    assert isinstance(queue.arrive("t", "normal", 4.0), Queued)
    refused = queue.arrive("t", "normal", 4.0)
    assert isinstance(refused, Reject) and refused.code == OVERLOADED
    assert refused.retry_after_s == pytest.approx(max(1.0, 2 * 0.8))  # two waiters at or above
    assert queue.counters[OVERLOADED] == 1


def test_default_class_per_tenant_and_unknown_class_is_an_error():
    limits = AdmissionLimits(max_in_flight=1, tenants={"batch": TenantLimits(priority="low")})
    queue = AdmissionQueue(limits)
    queue.arrive("x", None, 0.0)
    assert queue.arrive("batch", None, 0.0).ticket.rank == 2
    assert queue.arrive("x", None, 0.0).ticket.rank == 1
    with pytest.raises(ValueError, match="unknown priority 'urgent'"):
        queue.arrive("x", "urgent", 0.0)


def test_a_request_never_asks_above_its_tenants_ceiling():
    """x-raykv-priority is the caller's; max_priority is the operator's. A tenant held to
    "low" that sends "high" waits as "low"; lower classes than the default are granted."""
    limits = AdmissionLimits(max_in_flight=1, tenants={
        "batch": TenantLimits(priority="low", max_priority="low"),
        "std": TenantLimits(max_priority="normal")})
    queue = AdmissionQueue(limits)
    queue.arrive("x", None, 0.0)  # takes the slot: the rest queue with their rank
    assert queue.arrive("batch", "high", 0.0).ticket.rank == 2
    assert queue.arrive("std", "high", 0.0).ticket.rank == 1
    assert queue.arrive("std", "low", 0.0).ticket.rank == 2
    assert queue.arrive("x", "high", 0.0).ticket.rank == 0  # no ceiling set: as asked


def test_cancel_withdraws_only_waiting_tickets():
    queue = AdmissionQueue(AdmissionLimits(max_in_flight=1))
    running = queue.arrive("t", None, 0.0).ticket
    waiting = queue.arrive("t", None, 0.0).ticket
    assert queue.cancel(waiting) and not queue.cancel(waiting) and not queue.cancel(running)
    assert queue.finish(running, 1.0) is None


# ---- the asyncio gate ------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def run(coro):
    return asyncio.run(coro)


def test_gate_hands_slots_to_waiters_in_priority_order():
    async def scenario():
        gate = AdmissionGate(AdmissionLimits(max_in_flight=1, max_wait_s=5.0))
        order = []
        first = await gate.enter("t", None)

        async def one(name, priority):
            ticket = await gate.enter("t", priority)
            order.append(name)
            gate.leave(ticket)

        tasks = [asyncio.create_task(one("low", "low")), asyncio.create_task(one("hi", "high"))]
        await asyncio.sleep(0.01)
        assert gate.stats()["waiting"] == [1, 0, 1]
        gate.leave(first)
        await asyncio.gather(*tasks)
        return order, gate.stats()

    order, stats = run(scenario())
    assert order == ["hi", "low"] and stats["in_flight"] == 0


def test_gate_wait_is_bounded_and_becomes_overloaded():
    async def scenario():
        gate = AdmissionGate(AdmissionLimits(max_in_flight=1, max_wait_s=0.05))
        await gate.enter("t", None)  # never left: the slot stays taken
        start_s = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded) as refused:
            await gate.enter("t", None)
        return refused.value, asyncio.get_running_loop().time() - start_s, gate.stats()

    error, waited_s, stats = run(scenario())
    assert error.code == "overloaded" and error.retry_after_header == "1"
    assert 0.04 <= waited_s < 1.0
    assert stats["waiting"] == [0, 0, 0] and stats["timed_out"] == 1


def test_gate_rejects_at_once_when_rate_limited_or_full():
    async def scenario():
        limits = AdmissionLimits(max_in_flight=1, max_queued=0,
                                 tenants={"slow": TenantLimits(0.5, 1.0)})
        gate = AdmissionGate(limits, clock=Clock())
        ticket = await gate.enter("slow", None)
        errors = []
        for tenant in ("slow", "fast"):
            with pytest.raises(Overloaded) as refused:
                await gate.enter(tenant, None)
            errors.append(refused.value)
        gate.leave(ticket)
        return errors

    rate, full = run(scenario())
    assert (rate.code, rate.retry_after_s, rate.retry_after_header) == ("rate_limited", 2.0, "2")
    assert full.code == "overloaded"


def test_a_cancelled_waiter_leaves_the_queue_and_frees_nothing():
    async def scenario():
        gate = AdmissionGate(AdmissionLimits(max_in_flight=1, max_wait_s=5.0))
        first = await gate.enter("t", None)
        waiter = asyncio.create_task(gate.enter("t", None))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        waiting = gate.stats()["waiting"]
        gate.leave(first)
        return waiting, gate.stats()

    waiting, stats = run(scenario())
    assert waiting == [0, 0, 0] and stats["in_flight"] == 0


def test_overloaded_header_rounds_up():
    assert Overloaded("x", "overloaded", 0.2).retry_after_header == "1"
    assert Overloaded("x", "overloaded", 2.1).retry_after_header == "3"
    assert math.isinf(take_token(Bucket(0.0, 0.0), TenantLimits(0.0, 1.0), 0.0)[0])


def test_app_admission_args_become_limits():
    from cluster.serving.app import AdmissionArgs, AppArgs

    args = AdmissionArgs(max_in_flight=3, tenants={"acme": {"rate_per_s": 2, "priority": "low"},
                                                   "b": {"burst": 5}})
    limits = args.limits()
    assert (limits.max_in_flight, limits.max_queued, limits.max_wait_s) == (3, 64, 10.0)
    assert limits.tenant("acme") == TenantLimits(2.0, 2.0, "low")
    assert limits.tenant("b") == TenantLimits() and limits.tenant("zzz") == TenantLimits()
    assert AppArgs().admission.limits().max_in_flight == 256
    with pytest.raises(ValueError):
        AdmissionArgs(tenants={"acme": {"priority": "urgent"}})
    capped = AdmissionArgs(tenants={"acme": {"priority": "low", "max_priority": "low"}})
    assert capped.limits().tenant("acme") == TenantLimits(priority="low", max_priority="low")
    with pytest.raises(ValueError, match="above max_priority"):
        AdmissionArgs(tenants={"acme": {"priority": "normal", "max_priority": "low"}})
