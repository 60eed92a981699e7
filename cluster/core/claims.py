"""Shared in-flight work: the first request that needs a key does the work, later ones wait.

    claim([a, b, c])  ->  todo [a, c], waits {future of b}   (b is another request's)
    ... do the work for a and c ...
    finish(todo, done)       # wakes whoever waited on a or c

This is what keeps a burst of requests for one prefix from each reading it from disk, or
each pulling it from another node (vLLM's "convoy" behind one load).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable


class InflightClaims:
    """key -> the future of the request working on it."""

    def __init__(self) -> None:
        self._futures: dict[Hashable, asyncio.Future] = {}

    def claim(self, keys: Iterable[Hashable]) -> tuple[list, set[asyncio.Future], asyncio.Future]:
        """(keys now ours to work on, futures of others' work on the rest, our future).

        Must be called on the event loop, before the caller's first await, so a request
        arriving meanwhile finds the claim.
        """
        todo, waits = [], set()
        for key in dict.fromkeys(keys):
            future = self._futures.get(key)
            if future is None:
                todo.append(key)
            else:
                waits.add(future)
        done = asyncio.get_running_loop().create_future()
        self._futures.update(dict.fromkeys(todo, done))
        return todo, waits, done

    def finish(self, keys: Iterable[Hashable], done: asyncio.Future) -> None:
        """Forget our claims and wake the waiters (whatever the work's outcome)."""
        for key in keys:
            if self._futures.get(key) is done:
                del self._futures[key]
        if not done.done():
            done.set_result(None)

    @staticmethod
    async def wait(waits: Iterable[asyncio.Future]) -> None:
        """Wait for others' work; a waiter cancelled meanwhile does not cancel that work."""
        await asyncio.gather(*(asyncio.shield(w) for w in waits))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._futures

    def __len__(self) -> int:
        return len(self._futures)
