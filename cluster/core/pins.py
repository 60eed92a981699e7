"""Operator pins: pages an operator keeps on this node for a while (pure, no Ray).

    pin(pin_id, pages, ttl_s, cap_bytes)   a pin per prompt (its id: the prompt's last page
                                            key); pinning the same id again replaces it
    unpin(pin_id)                          ends it early
    holds(key)                             whether a live pin covers the page

A pinned page is never a victim of eviction (the pool's is_pinned asks holds()), beside the
readers' lease pins. Pins expire at their deadline on the monotonic clock, with no thread:
holds() sweeps the expired ones when the earliest deadline has passed, and so does every
pin, unpin and stats call. Pins of several prompts may share pages (a system prompt and a
longer conversation): a page is held while any pin covers it, and counted once against the
cap. A pin that would hold more than `cap_bytes` is refused whole (PinRefused): nothing
changes, so nothing is half-pinned.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from cluster.core.keys import PageKey


class PinRefused(ValueError):
    """A pin past the node's cap on pinned memory."""


@dataclass(frozen=True, slots=True)
class Pin:
    pages: dict[PageKey, int]  # key -> the bytes it holds
    deadline_s: float  # on the monotonic clock


def check_ttl(ttl_s: float) -> float:
    """A pin's TTL: a positive, finite number of seconds; ValueError otherwise."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (
            0 < ttl_s < math.inf):
        raise ValueError(f"ttl_s must be a positive, finite number of seconds, got {ttl_s!r}")
    return float(ttl_s)


class PinSet:
    """The live pins of one node, with the pages they hold and their bytes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.pins: dict[bytes, Pin] = {}
        self.counts: Counter[PageKey] = Counter()  # page -> pins holding it (no zeros)
        self.pinned_bytes = 0
        self.num_expired = 0
        self._next_deadline_s = math.inf

    def holds(self, key: PageKey) -> bool:
        """Whether a live pin holds the page (expired pins are swept first)."""
        if not self.counts:
            return False
        if self.clock() >= self._next_deadline_s:
            self.sweep()
        return key in self.counts

    def pin(self, pin_id: bytes, pages: dict[PageKey, int], ttl_s: float,
            cap_bytes: int) -> Pin | None:
        """Pin `pages` (key -> bytes) under `pin_id` for `ttl_s`, replacing a pin of that id;
        returns the pin replaced (None: there was none). PinRefused when the pinned pages
        would hold more than `cap_bytes`; then nothing changes. No pages: the pin ends."""
        ttl_s = check_ttl(ttl_s)
        self.sweep()
        old = self.pins.get(pin_id)
        if not pages:
            self.unpin(pin_id)
            return old
        leaving = {k for k in old.pages if self.counts[k] == 1} if old else set()
        after_bytes = (self.pinned_bytes - sum(old.pages[k] for k in leaving if k not in pages)
                       + sum(b for k, b in pages.items() if k not in self.counts))
        if after_bytes > cap_bytes:
            raise PinRefused(
                f"pinning {len(pages)} pages ({sum(pages.values())} bytes) would hold "
                f"{after_bytes} bytes pinned on this node, past its cap of {cap_bytes} bytes "
                f"(CacheConfig.max_pinned_fraction of its memory); unpin a prefix first")
        if old is not None:
            self._remove(pin_id)
        self._add(pin_id, Pin(dict(pages), self.clock() + ttl_s))
        return old

    def unpin(self, pin_id: bytes) -> list[PageKey]:
        """End a pin now; returns the pages it held ([] when there was none)."""
        self.sweep()
        if pin_id not in self.pins:
            return []
        return list(self._remove(pin_id).pages)

    def remaining_s(self, pin: Pin) -> float:
        return max(0.0, pin.deadline_s - self.clock())

    def sweep(self) -> int:
        """End the pins past their deadline; returns how many ended."""
        now_s = self.clock()
        if now_s < self._next_deadline_s:
            return 0
        expired = [pin_id for pin_id, pin in self.pins.items() if pin.deadline_s <= now_s]
        for pin_id in expired:
            self._remove(pin_id)
        self.num_expired += len(expired)
        self._next_deadline_s = min((p.deadline_s for p in self.pins.values()), default=math.inf)
        return len(expired)

    def stats(self) -> dict:
        self.sweep()
        return {"pins": len(self.pins), "pinned_pages": len(self.counts),
                "pinned_bytes": self.pinned_bytes, "expired_pins": self.num_expired}

    def _add(self, pin_id: bytes, pin: Pin) -> None:
        for key, num_bytes in pin.pages.items():
            if key not in self.counts:
                self.pinned_bytes += num_bytes
            self.counts[key] += 1
        self.pins[pin_id] = pin
        self._next_deadline_s = min(self._next_deadline_s, pin.deadline_s)

    def _remove(self, pin_id: bytes) -> Pin:
        pin = self.pins.pop(pin_id)
        for key, num_bytes in pin.pages.items():
            self.counts[key] -= 1
            if self.counts[key] <= 0:
                del self.counts[key]
                self.pinned_bytes -= num_bytes
        return pin
