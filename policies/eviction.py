"""Eviction policies: which page of a tier to demote next.

Pure Python (no ray, torch or numpy). A policy only orders keys; the tier moves the bytes.

The node store drives one policy per tier:

    insert page   -> on_insert(key)
    hit           -> on_access(key)
    need room     -> victims(n, is_pinned)   # suggestions; nothing is removed
    page leaves   -> on_remove(key)          # evicted, promoted, deleted: any reason

Keys are any hashable (page keys are 16-byte ``bytes``). Unknown keys are harmless in
``on_access`` and ``on_remove``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol, runtime_checkable

Key = Hashable
IsPinned = Callable[[Key], bool]

MAX_FREQ = 3  # S3-FIFO's 2-bit saturating access counter
SMALL_FRACTION = 0.1


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the keys of one tier for eviction."""

    def on_insert(self, key: Key) -> None: ...

    def on_access(self, key: Key) -> None: ...

    def on_remove(self, key: Key) -> None: ...

    def victims(self, num_pages: int, is_pinned: IsPinned) -> list[Key]:
        """Up to num_pages distinct unpinned keys, first to evict first; removes none."""
        ...

    def __len__(self) -> int: ...


def _check_num_pages(num_pages: int) -> None:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
        raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")


def _check_capacity(capacity_pages: int) -> None:
    if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int):
        raise ValueError(f"capacity_pages must be an int, got {capacity_pages!r}")
    if capacity_pages <= 0:
        raise ValueError(f"capacity_pages must be positive, got {capacity_pages}")


class LRUPolicy:
    """Least recently used first.

    oldest                      newest
    [k3] -> [k1] -> [k4] -> [k2]        on_access(k1): move k1 to newest
     ^ victims() start here
    """

    def __init__(self, capacity_pages: int = 1) -> None:
        _check_capacity(capacity_pages)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self, num_pages: int, is_pinned: IsPinned) -> list[Key]:
        """Oldest unpinned keys first. O(pinned + num_pages)."""
        _check_num_pages(num_pages)
        out: list[Key] = []
        for key in self._order:
            if len(out) >= num_pages:
                break
            if not is_pinned(key):
                out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP'23): three FIFO queues and a 2-bit frequency per key.

        insert --> small (~10%) --freq>0--> main (~90%) --freq>0: freq-1, back to new end
                     | freq==0                | freq==0
                     v                        v
                   victim                   victim
        on_remove of a key in small --> ghost (keys only, bounded; FIFO)
        insert of a key found in ghost --> straight into main

    Every queue is an OrderedDict (old end first), so on_remove is O(1).

    ``victims()`` never adds or removes a visible key, but it does run the algorithm's
    queue maintenance: it moves small keys with freq>0 to main (freq reset to 0) and sends
    main keys with freq>0 back to main's new end with freq-1. Pinned keys and chosen
    victims keep their places. Any key that leaves small via ``on_remove`` (not only a
    chosen victim) is remembered in ghost, so a re-inserted key goes to main.
    """

    def __init__(self, capacity_pages: int) -> None:
        _check_capacity(capacity_pages)
        self.small_target_pages = max(1, int(capacity_pages * SMALL_FRACTION))
        self.ghost_capacity_pages = max(1, capacity_pages - self.small_target_pages)
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> freq
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key) -> None:
        if key in self._small or key in self._main:
            self.on_access(key)
        elif key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def on_access(self, key: Key) -> None:
        for queue in (self._small, self._main):
            if key in queue:
                queue[key] = min(MAX_FREQ, queue[key] + 1)
                return

    def on_remove(self, key: Key) -> None:
        if self._small.pop(key, None) is not None:
            self._ghost[key] = None
            self._ghost.move_to_end(key)
            while len(self._ghost) > self.ghost_capacity_pages:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victims(self, num_pages: int, is_pinned: IsPinned) -> list[Key]:
        """Run S3-FIFO eviction without evicting (see the class docstring).

        Worst case O(len) when most keys are pinned; amortised O(num_pages) otherwise.
        """
        _check_num_pages(num_pages)
        out: list[Key] = []
        parked_small: list[tuple[Key, int]] = []  # popped, put back at the old end after
        parked_main: list[tuple[Key, int]] = []
        num_pinned_small = 0
        try:
            while len(out) < num_pages:
                queue = self._next_queue(num_pinned_small)
                if queue is None:
                    break
                key, freq = queue.popitem(last=False)
                in_small = queue is self._small
                pinned = is_pinned(key)
                if pinned or freq == 0:
                    (parked_small if in_small else parked_main).append((key, freq))
                    num_pinned_small += int(pinned and in_small)
                    if not pinned:
                        out.append(key)
                else:
                    self._main[key] = 0 if in_small else freq - 1
        finally:
            self._unpark(self._small, parked_small)
            self._unpark(self._main, parked_main)
        return out

    def _next_queue(self, num_pinned_small: int) -> OrderedDict[Key, int] | None:
        """Small while it holds >= its target (pinned keys count, chosen victims don't)."""
        if self._small and len(self._small) + num_pinned_small >= self.small_target_pages:
            return self._small
        if self._main:
            return self._main
        return self._small or None

    @staticmethod
    def _unpark(queue: OrderedDict[Key, int], parked: list[tuple[Key, int]]) -> None:
        """Put popped keys back at the old end, in their original order."""
        for key, freq in reversed(parked):
            queue[key] = freq
            queue.move_to_end(key, last=False)

    def queue_of(self, key: Key) -> str | None:
        """Which queue holds key: "small", "main", "ghost" or None (for stats and tests)."""
        for name, queue in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if key in queue:
                return name
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: Key) -> bool:
        return key in self._small or key in self._main


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
}


def make_policy(name: str, capacity_pages: int) -> EvictionPolicy:
    """A fresh policy from the registry; ValueError naming the known ones if unknown."""
    cls = EVICTION_POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; known policies: {known}")
    return cls(capacity_pages)
