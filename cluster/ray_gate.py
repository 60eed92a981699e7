"""raykv's background threads and `ray.shutdown()`, kept out of each other's way.

A client's reports (touches.py: reads, demand, metrics) and its leased-put commits (puts.py)
go from threads of their own. Ray's C++ core worker ends the whole process (exit status 1,
"The core worker has already been shutdown ... The process will exit") when a thread reaches
it while `ray.shutdown()` tears it down, as a call or as an ObjectRef dropped at that moment.
CI's run on 4aebc37 lost its pytest process that way, as a test module's fixture shut Ray
down (the driver's log named a thread other than the main one).

So each background call runs inside `background_call()`, and `ray.shutdown()` (wrapped here,
once, when this module is imported) first closes the gate: no background call starts, and
the shutdown waits (at most DRAIN_S) for those in flight. Their waits look at the gate every
WAIT_SLICE_S and give up (calls.py), dropping their refs while Ray is still whole. At
interpreter exit the gate is closed the same way before Ray's own exit hook shuts it down
(this module registers its hook after Ray's, and exit hooks run last-registered first).

A call refused at the gate is a report lost or a commit that misses, as with a dead node.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray

log = logging.getLogger("raykv.client")
DRAIN_S = 5.0  # the most a shutdown waits for background calls in flight
WAIT_SLICE_S = 0.1  # a background wait looks at the gate this often

_cond = threading.Condition()
_state = {"closed": False, "in_flight": 0}
_local = threading.local()


def _ray_is_up() -> bool:
    return ray.is_initialized()


@contextmanager
def background_call() -> Iterator[bool]:
    """Yields whether a background thread may call Ray now: Ray is up here and no shutdown
    has begun. While the block runs, a shutdown waits for it (at most DRAIN_S)."""
    with _cond:
        allowed = not _state["closed"] and _ray_is_up()
        if allowed:
            _state["in_flight"] += 1
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield allowed
    finally:
        _local.depth = depth
        if allowed:
            with _cond:
                _state["in_flight"] -= 1
                _cond.notify_all()


def in_background() -> bool:
    """Whether this thread is inside background_call() (its waits then watch the gate)."""
    return getattr(_local, "depth", 0) > 0


def closing() -> bool:
    """Whether a shutdown has closed the gate: background waits give up."""
    return _state["closed"]


def close(drain_s: float = DRAIN_S) -> bool:
    """Close the gate and wait for the background calls in flight (other threads' only);
    False when some were still running after drain_s."""
    own = 1 if in_background() else 0
    with _cond:
        _state["closed"] = True
        drained = _cond.wait_for(lambda: _state["in_flight"] <= own, drain_s)
    if not drained:
        log.warning("ray.shutdown() went ahead with %d raykv background call(s) in flight",
                    _state["in_flight"] - own)
    return drained


def reopen() -> None:
    """Open the gate again (after a shutdown: calls still need ray.is_initialized())."""
    with _cond:
        _state["closed"] = False


def _guarded(shutdown):
    @functools.wraps(shutdown)
    def guarded_shutdown(*args, **kwargs):
        close()
        try:
            return shutdown(*args, **kwargs)
        finally:
            reopen()

    guarded_shutdown.__raykv_gated__ = True
    return guarded_shutdown


def _install() -> None:
    if not getattr(ray.shutdown, "__raykv_gated__", False):
        ray.shutdown = _guarded(ray.shutdown)
    atexit.register(close)


def wait_slices(timeout_s: float) -> Iterator[float]:
    """The timeouts of a wait of at most timeout_s: one slice outside background_call(),
    else WAIT_SLICE_S at a time, ending early once the gate closes."""
    if not in_background():
        yield timeout_s
        return
    deadline_s = time.monotonic() + timeout_s
    while not closing() and (left_s := deadline_s - time.monotonic()) > 0:
        yield min(WAIT_SLICE_S, left_s)


_install()
