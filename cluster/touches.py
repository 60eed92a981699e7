"""What a client's gets tell the service after the fact, in batches: their node, pages read
straight from shared memory and the read leases they are done with (TouchBatch); the
directory, the prefixes this node served whole without asking it (DemandBatch).

An optimistic read makes no call; the node still needs to hear of it, for its eviction policy
(an access) and its counters (a hit, a request served). The first read after a quiet spell is
sent at once; later ones are gathered for up to TOUCH_EVERY_S and sent together by a timer, so
a burst of reads costs one call per interval and none is left untold.

A get that took a lease (the node's acquire pinned its pages) lets go of it with no call of its
own: the lease rides on the client's next acquire (`take_released`), or on this batch's timer
within TOUCH_EVERY_S. A release only ends pins, so a late one merely keeps pages from eviction
a moment longer, and a lease never released (a dead client) still lapses at its deadline.

A get whose node's acquire held the whole prefix asks the directory nothing (fetch.py), but the
directory's demand tracker (cluster/core/demand.py: hot prefixes for burst detection,
replication, migration) still counts the request: its keys are sent by a timer within
TOUCH_EVERY_S, never on the get's path, as the match would have recorded them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cluster.core.keys import PageKey

TOUCH_EVERY_S = 0.5  # at most one report per interval


class _TimedBatch:
    """The send timer the batches share: started when something waits to be sent (under
    the batch's lock), stopped by the flush that sends it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def flush(self) -> None:
        raise NotImplementedError

    def _start_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(TOUCH_EVERY_S, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        self._timer = None


class TouchBatch(_TimedBatch):
    """Gathers (keys, reads, released lease ids) and hands them to
    `send(keys, num_reads, released)`, fire and forget."""

    def __init__(self, send: Callable[[list[PageKey], int, list[int]], object]):
        super().__init__()
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
            due = time.monotonic() - self._sent_at_s >= TOUCH_EVERY_S
            if not due:
                self._start_timer()
        if due:
            self.flush()

    def release(self, lease_id: int) -> None:
        """A lease this client is done with: sent with its next acquire or by the timer."""
        with self._lock:
            self._released.append(lease_id)
            self._start_timer()

    def take_released(self) -> list[int]:
        """The leases gathered so far, for a call about to go to the node anyway."""
        with self._lock:
            released, self._released = self._released, []
        return released

    def flush(self) -> None:
        """Send what has gathered, now."""
        with self._lock:
            self._stop_timer()
            if not self._keys and not self._released:
                return
            keys, reads, released = list(dict.fromkeys(self._keys)), self._reads, self._released
            self._keys, self._reads, self._released = [], 0, []
            self._sent_at_s = time.monotonic()
        self.send(keys, reads, released)


class DemandBatch(_TimedBatch):
    """Gathers the key chains of requests served without a directory match and hands them to
    `send(requests)` from a timer, at most one call per TOUCH_EVERY_S, fire and forget."""

    def __init__(self, send: Callable[[list[list[PageKey]]], object]):
        super().__init__()
        self.send = send
        self._requests: list[list[PageKey]] = []

    def note(self, keys: list[PageKey]) -> None:
        """One request that matched all of `keys`."""
        if not keys:
            return
        with self._lock:
            self._requests.append(keys)
            self._start_timer()

    def flush(self) -> None:
        """Send what has gathered, now."""
        with self._lock:
            self._stop_timer()
            requests, self._requests = self._requests, []
        if requests:
            self.send(requests)
