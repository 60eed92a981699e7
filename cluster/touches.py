"""What a client's gets tell the service after the fact, in batches: their node, pages read
straight from shared memory and the read leases they are done with (TouchBatch); the
directory, the prefixes this node served whole without asking it (DemandBatch); Ray's metrics,
every call's latency and bytes moved (MetricBatch).

An optimistic read makes no call; the node still needs to hear of it, for its eviction policy
(an access) and its counters (a hit, a request served). The first read after a quiet spell is
sent TOUCH_SOON_S later; later ones are gathered for up to TOUCH_EVERY_S and sent together, so
a burst of reads costs one call per interval and none is left untold. One thread per process
sends every batch when it falls due (_Sender): never the get's own thread, whose caller is
waiting for its pages (the call's Python took ~0.7 ms of a get here when the get sent it), and
never a thread of its own per timer (a thread started on a get's path).

A get that took a lease (the node's acquire pinned its pages) lets go of it with no call of its
own: the lease rides on the client's next acquire (`take_released`), or on this batch's send
within TOUCH_EVERY_S. A release only ends pins, so a late one merely keeps pages from eviction
a moment longer, and a lease never released (a dead client) still lapses at its deadline.

A get whose node's acquire held the whole prefix asks the directory nothing (fetch.py), but the
directory's demand tracker (cluster/core/demand.py: hot prefixes for burst detection,
replication, migration) still counts the request: its keys are sent within TOUCH_EVERY_S,
never on the get's path, as the match would have recorded them.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from cluster.core import cpu_sets
from cluster.core.keys import PageKey

log = logging.getLogger("raykv.client")
TOUCH_EVERY_S = 0.5  # at most one report per interval
# The first read after a quiet spell is sent this long after it: by then its get has
# returned, and the send runs beside what the caller does next.
TOUCH_SOON_S = 0.002
# A batch's sends may need a gate (ray_gate.background_call: Ray up, no shutdown under way);
# it yields whether to send now. Without one, a batch always sends (unit tests' fakes).
Gate = Callable[[], AbstractContextManager[bool]]


def ungated() -> AbstractContextManager[bool]:
    """The gate of a batch given none: always open."""
    return nullcontext(True)


class _Sender:
    """The thread that sends every batch of this process when it falls due: a heap of
    (due time, batch), a batch's flush called once its time comes (a batch scheduled twice
    is flushed twice; the second finds it empty, or sends what gathered since)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, _TimedBatch]] = []
        self._order = itertools.count()  # ties by arrival: batches are not ordered
        self._thread: threading.Thread | None = None

    def schedule(self, batch: _TimedBatch, due_s: float) -> None:
        with self._cond:
            heapq.heappush(self._due, (due_s, next(self._order), batch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raykv-touches",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        cpu_sets.follow()
        while True:
            with self._cond:
                while not self._due or (wait_s := self._due[0][0] - time.monotonic()) > 0:
                    self._cond.wait(wait_s if self._due else None)
                _, _, batch = heapq.heappop(self._due)
            try:
                batch.send_due()
            except Exception:  # a send is fire and forget: a failed one is a lost report
                log.exception("a batch of reads could not be sent")


_sender = _Sender()
# A forked child has none of the parent's threads: it starts its own sender, with an empty
# heap and a lock no parent thread may have held (reports gathered before the fork are the
# parent's to send).
os.register_at_fork(after_in_child=_sender.__init__)


class _TimedBatch:
    """A batch the sender flushes when due: scheduled when something waits to be sent (under
    the batch's lock), at most one pending time at once (an earlier one replaces it)."""

    def __init__(self, gate: Gate | None = None):
        self._lock = threading.Lock()
        self._due_s: float | None = None
        self._gate = gate or ungated

    def flush(self) -> None:
        raise NotImplementedError

    def send_due(self) -> None:
        """The sender's call: flush, unless a flush since made this time moot."""
        with self._lock:
            due = self._due_s is not None and self._due_s <= time.monotonic()
        if due:
            with self._gate() as allowed:
                if allowed:  # else Ray is gone or going: nothing to tell
                    self.flush()

    def _schedule(self, delay_s: float) -> None:
        now_s = time.monotonic()
        due_s = now_s + delay_s
        # A pending time already past is pushed again: the sender is about to flush (a second
        # entry then finds nothing) or lost its heap (a fork); either way nothing stays untold.
        if self._due_s is None or due_s < self._due_s or self._due_s <= now_s:
            self._due_s = due_s
            _sender.schedule(self, due_s)

    def _sent(self) -> None:
        self._due_s = None


class TouchBatch(_TimedBatch):
    """Gathers (keys, reads, released lease ids) and hands them to
    `send(keys, num_reads, released)`, fire and forget."""

    def __init__(self, send: Callable[[list[PageKey], int, list[int]], object],
                 gate: Gate | None = None):
        super().__init__(gate)
        self.send = send
        self._keys: list[PageKey] = []
        self._reads = 0
        self._released: list[int] = []
        self._sent_at_s = -TOUCH_EVERY_S

    def note(self, keys: list[PageKey]) -> None:
        """One read of `keys`."""
        if not keys:
            return
        with self._lock:
            self._keys.extend(keys)
            self._reads += 1
            self._schedule_report()

    def release(self, lease_id: int) -> None:
        """A lease this client is done with: sent with its next acquire or the next report
        (within TOUCH_EVERY_S)."""
        with self._lock:
            self._released.append(lease_id)
            self._schedule(TOUCH_EVERY_S)

    def _schedule_report(self) -> None:
        """Due TOUCH_SOON_S from now after a quiet spell, else TOUCH_EVERY_S after the last
        report (under the lock)."""
        since_s = time.monotonic() - self._sent_at_s
        self._schedule(max(TOUCH_SOON_S, TOUCH_EVERY_S - since_s))

    def take_released(self) -> list[int]:
        """The leases gathered so far, for a call about to go to the node anyway."""
        with self._lock:
            released, self._released = self._released, []
        return released

    def flush(self) -> None:
        """Send what has gathered, now."""
        with self._lock:
            self._sent()
            if not self._keys and not self._released:
                return
            keys, reads, released = list(dict.fromkeys(self._keys)), self._reads, self._released
            self._keys, self._reads, self._released = [], 0, []
            self._sent_at_s = time.monotonic()
        self.send(keys, reads, released)


class DemandBatch(_TimedBatch):
    """Gathers the key chains of requests served without a directory match and hands them to
    `send(requests)` from the sender, at most one call per TOUCH_EVERY_S, fire and forget."""

    def __init__(self, send: Callable[[list[list[PageKey]]], object],
                 gate: Gate | None = None):
        super().__init__(gate)
        self.send = send
        self._requests: list[list[PageKey]] = []

    def note(self, keys: list[PageKey]) -> None:
        """One request that matched all of `keys`."""
        if not keys:
            return
        with self._lock:
            self._requests.append(keys)
            self._schedule(TOUCH_EVERY_S)

    def flush(self) -> None:
        """Send what has gathered, now."""
        with self._lock:
            self._sent()
            requests, self._requests = self._requests, []
        if requests:
            self.send(requests)


class MetricBatch(_TimedBatch):
    """A client's calls as metrics (latency, bytes moved per path, remote fetch time), handed
    to `metrics()` (made on the sender's first flush) from the sender within TOUCH_EVERY_S,
    never on the call's path: each Ray metric record is ~10 us of Python in a warm loop and
    ~40 us right after a large copy, and a get made two to four of them."""

    def __init__(self, metrics: Callable[[], object], gate: Gate | None = None):
        super().__init__(gate)
        self._make = metrics
        self._metrics = None
        self._calls: list[tuple[str, float, tuple, float]] = []

    def note(self, call: str, latency_s: float, moved: tuple[tuple[str, int], ...],
             fetch_s: float = 0.0) -> None:
        """One call: its latency, its (path, bytes moved) and its remote fetch time (0: none)."""
        with self._lock:
            self._calls.append((call, latency_s, moved, fetch_s))
            self._schedule(TOUCH_EVERY_S)

    def flush(self) -> None:
        """Record what has gathered, now (bytes summed per path: one record each)."""
        with self._lock:
            self._sent()
            calls, self._calls = self._calls, []
        if not calls:
            return
        if self._metrics is None:
            self._metrics = self._make()
        moved_bytes: dict[str, int] = {}
        for call, latency_s, moved, fetch_s in calls:
            self._metrics.observe(f"raykv_{call}_latency_s", latency_s)
            if fetch_s:
                self._metrics.observe("raykv_fetch_latency_s", fetch_s)
            for path, num_bytes in moved:
                moved_bytes[path] = moved_bytes.get(path, 0) + num_bytes
        for path, num_bytes in moved_bytes.items():
            self._metrics.count("raykv_bytes_moved", num_bytes, path=path)
