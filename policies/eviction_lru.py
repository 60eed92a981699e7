"""LRU: the least recently used page is demoted first (policy "lru")."""

from __future__ import annotations

from collections import OrderedDict

from policies.eviction_base import IsPinned, Key, PerKeyBatches, _check_capacity, _check_num_pages


class LRUPolicy(PerKeyBatches):
    """Least recently used first.

    oldest                      newest
    [k3] -> [k1] -> [k4] -> [k2]        on_access(k1): move k1 to newest
     ^ victims() start here
    """

    def __init__(self, capacity_pages: int = 1) -> None:
        _check_capacity(capacity_pages)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
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
