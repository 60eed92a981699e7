"""PrefixLRU: one engine replica's own prefix cache, the index part (pure: no Ray, no torch).

What an engine runs without raykv: vLLM's automatic prefix caching keeps the KV blocks of
earlier requests in the replica's own memory, keyed by a chained hash of the block's tokens
and everything before it, and reuses the longest cached prefix of a new prompt. Nothing is
shared between replicas. Here the blocks are raykv's pages and the keys are raykv's page
keys (cluster/core/keys.py), so both caches count hits in the same whole pages.

Eviction is least recently used, with vLLM's order within one prompt: a prompt's pages are
touched tail first, so the page nearest the start is the most recent and a chain loses its
tail before its head (its head is what other prompts share):

    oldest ............................................. newest
    [other pages ...] [key_n-1] ... [key_2] [key_1] [key_0]
     ^ evicted first

A chain is reachable only from key_0 on (`match` walks from the first page to the first
miss), so evicting tails first keeps every held page useful.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

Value = TypeVar("Value")
_MISSING = object()


class PrefixLRU(Generic[Value]):
    """Pages of `page_bytes` each under `capacity_bytes`, keyed by chain keys; LRU."""

    def __init__(self, capacity_bytes: int, page_bytes: int):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if capacity_bytes < page_bytes:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) holds no page of "
                             f"{page_bytes} bytes")
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_bytes // page_bytes
        self._pages: OrderedDict[Hashable, Value] = OrderedDict()  # oldest first
        self.counters = {"matched_pages": 0, "missed_pages": 0, "stored_pages": 0,
                         "evicted_pages": 0}

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pages

    @property
    def used_bytes(self) -> int:
        return len(self._pages) * self.page_bytes

    def match(self, keys: Sequence[Hashable]) -> list[Value]:
        """The values of the longest held prefix of `keys`, which become the most recent.
        A page past that prefix counts as a miss (one per call)."""
        found = []
        for key in keys:
            value = self._pages.get(key, _MISSING)
            if value is _MISSING:
                break
            found.append(value)
        self._touch(keys[: len(found)])
        self.counters["matched_pages"] += len(found)
        self.counters["missed_pages"] += int(len(found) < len(keys))
        return found

    def insert(self, keys: Sequence[Hashable], make_value: Callable[[int], Value]) -> int:
        """Hold the pages of `keys` (at most capacity_pages of them, from the first), making
        the value of page i with make_value(i) only when it is not held; evicts the least
        recently used other pages for room. Returns how many of `keys` are now held."""
        chain = keys[: self.capacity_pages]
        for key in chain:  # held pages of the chain first, so that none is evicted for room
            if key in self._pages:
                self._pages.move_to_end(key)
        protected = set(chain)
        for index, key in enumerate(chain):
            if key not in self._pages:
                self._make_room(protected)
                self._pages[key] = make_value(index)
                self.counters["stored_pages"] += 1
        self._touch(chain)
        return len(chain)

    def _make_room(self, protected: set) -> None:
        """Evict the oldest pages until one more fits; the chain being inserted (at the newest
        end, and not longer than the capacity) is never the oldest."""
        while len(self._pages) >= self.capacity_pages:
            oldest = next(iter(self._pages))
            assert oldest not in protected, "a chain longer than the capacity was inserted"
            del self._pages[oldest]
            self.counters["evicted_pages"] += 1

    def _touch(self, keys: Sequence[Hashable]) -> None:
        """Make `keys` the newest, key_0 newest of all (tail first; see module docstring)."""
        for key in reversed(keys):
            self._pages.move_to_end(key)
