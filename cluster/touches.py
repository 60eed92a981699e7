"""Pages a client read straight from shared memory, told to their node in batches.

An optimistic read makes no call; the node still needs to hear of it, for its eviction policy
(an access) and its counters (a hit, a request served). The first read after a quiet spell is
sent at once; later ones are gathered for up to TOUCH_EVERY_S and sent together by a timer, so
a burst of reads costs one call per interval and none is left untold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cluster.core.keys import PageKey

TOUCH_EVERY_S = 0.5  # at most one report per interval


class TouchBatch:
    """Gathers (keys, reads) and hands them to `send(keys, num_reads)`, fire and forget."""

    def __init__(self, send: Callable[[list[PageKey], int], object]):
        self.send = send
        self._lock = threading.Lock()
        self._keys: list[PageKey] = []
        self._reads = 0
        self._sent_at_s = -TOUCH_EVERY_S
        self._timer: threading.Timer | None = None

    def note(self, keys: list[PageKey]) -> None:
        """One read of `keys`."""
        if not keys:
            return
        with self._lock:
            self._keys.extend(keys)
            self._reads += 1
            due = time.monotonic() - self._sent_at_s >= TOUCH_EVERY_S
            if not due and self._timer is None:
                self._timer = threading.Timer(TOUCH_EVERY_S, self.flush)
                self._timer.daemon = True
                self._timer.start()
        if due:
            self.flush()

    def flush(self) -> None:
        """Send what has gathered, now."""
        with self._lock:
            if self._timer is not None and self._timer is not threading.current_thread():
                self._timer.cancel()
            self._timer = None
            if not self._keys:
                return
            keys, reads = list(dict.fromkeys(self._keys)), self._reads
            self._keys, self._reads, self._sent_at_s = [], 0, time.monotonic()
        self.send(keys, reads)
