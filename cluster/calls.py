"""How the client waits: one piece of call logic, driven synchronously or from asyncio.

Each client operation is written once as a generator of steps:

    results = yield Wait([ref, ref])   # each result is the value or the exception it raised
    value   = yield Work(fn)           # CPU work (page copies): inline, or in a thread

`run_sync` resolves a Wait with ray.wait/ray.get; `run_async` awaits the refs, so a Serve
replica's event loop never blocks. Both give every Wait the same timeout, and hand a timeout
or a dead actor back as an exception value: the step logic turns it into a miss. Unit tests
drive the same generators with fakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from cluster import ray_gate

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Wait:
    refs: list


@dataclass(frozen=True, slots=True)
class Work:
    fn: Callable[[], Any]


Steps = Generator[Wait | Work, Any, T]


def failed(result: object) -> bool:
    return isinstance(result, BaseException)


def timed_out(result: object) -> bool:
    """A Wait's result for a call that did not answer in time: the call may still run, and
    land, after its waiter has gone on (see when_answered)."""
    return isinstance(result, TimeoutError)


def when_answered(ref: Any, handle: Callable[[Any], None]) -> None:
    """Call `handle(value)` once the call behind `ref` answers, for a waiter that gave up on
    it: an acquire past its timeout still pins its pages when it lands, and its lease must be
    let go then, not left to lapse. Nothing happens if the call fails. `handle` runs in Ray's
    callback thread (or here, if the answer is in already): it must be quick, thread-safe and
    make no call of its own."""

    def done(future) -> None:
        try:
            value = future.result()
        except BaseException:  # noqa: BLE001 - a failed call holds nothing to let go
            return
        handle(value)

    ref.future().add_done_callback(done)


def run_sync(steps: Steps[T], timeout_s: float) -> T:
    """Drive `steps` in this thread, blocking on each Wait for at most `timeout_s`."""
    reply = None
    try:
        while True:
            step = steps.send(reply)
            reply = _wait_sync(step.refs, timeout_s) if isinstance(step, Wait) else step.fn()
    except StopIteration as done:
        return done.value


async def run_async(steps: Steps[T], timeout_s: float) -> T:
    """Drive `steps` on the running event loop; copies run in a worker thread."""
    reply = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Wait):
                reply = await _wait_async(step.refs, timeout_s)
            else:
                reply = await asyncio.to_thread(step.fn)
    except StopIteration as done:
        return done.value


def _wait_sync(refs: list, timeout_s: float) -> list:
    if not refs:
        return []
    if not ray.is_initialized():  # ray.wait would start a local Ray (a background thread's
        # call that outlived the process's ray.shutdown(): each is a failed call instead)
        return [RuntimeError("this process left Ray") for _ in refs]
    ready, pending = set(), list(refs)
    # One wait; a background thread's in slices that give up once ray.shutdown() begins
    # (ray_gate.py: a wait still blocked when it tears Ray down can end the process).
    for slice_s in ray_gate.wait_slices(timeout_s):
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=slice_s)
        ready.update(done)
        if not pending:
            break
    results = []
    for ref in refs:
        if ref not in ready:
            results.append(RuntimeError("Ray is shutting down") if ray_gate.closing()
                           else TimeoutError(f"no answer within {timeout_s} s"))
            continue
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayError as error:
            results.append(error)
    return results


async def _wait_async(refs: list, timeout_s: float) -> list:
    async def one(ref):
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except asyncio.TimeoutError:  # asyncio's says nothing: name it as the sync path does
            raise TimeoutError(f"no answer within {timeout_s} s") from None

    return list(await asyncio.gather(*(one(ref) for ref in refs), return_exceptions=True))
