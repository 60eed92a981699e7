"""S3-FIFO: three FIFO queues and a 2-bit access counter per page (policy "s3fifo")."""

from __future__ import annotations

from collections import OrderedDict

from policies.eviction_base import IsPinned, Key, PerKeyBatches, _check_capacity, _check_num_pages

MAX_FREQ = 3  # S3-FIFO's 2-bit saturating access counter
SMALL_FRACTION = 0.1


class S3FIFOPolicy(PerKeyBatches):
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

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
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
